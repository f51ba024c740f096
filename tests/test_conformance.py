"""FlashInfer 0.7's parameters beyond the seed's API: implemented ones against the reference, the others
rejected by name; engine glue (fast_decode_plan, a settable _backend); import without CUDA initialisation.

CPU tests run the PyTorch path; ``interpret`` tests run the Triton kernels in Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flashinfer_triton as fi
from conftest import INTERPRET, assert_close
from flashinfer_triton import reference as R
from helpers import i32, make_paged

DT = torch.float16
ATOL = 2e-2
WS = 1 << 20


def close(got, expected, what, atol=ATOL):
    assert_close(got, torch.as_tensor(expected), atol, 0.0, name=what)


def ws():
    return torch.empty(WS, dtype=torch.uint8)


def _decode_case(kv_lens=(9, 4, 23), page_size=4, hq=4, hkv=2, d=32, seed=0):
    torch.manual_seed(seed)
    cache, indptr, indices, last, ks, vs = make_paged(list(kv_lens), page_size, hkv, d, DT, "cpu")
    return cache, indptr, indices, last, ks, vs


# ----------------------------------------------------------------------------- multi-token decode
@pytest.mark.parametrize("q_len", [2, 3])
def test_multi_token_decode(q_len):
    """q_len_per_req rows a request, causal within the request and aligned to its last key (FlashInfer 0.7)."""
    cache, indptr, indices, last, ks, vs = _decode_case()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=q_len, logits_soft_cap=8.0)
    q = torch.randn(3 * q_len, 4, 32, dtype=DT)
    out = torch.full_like(q, float("nan"))
    o, lse = w.run(q, cache, out=out, return_lse=True)
    assert o is out
    for b in range(3):
        rows = slice(b * q_len, (b + 1) * q_len)
        eo, el = R.attention(q[rows], ks[b], vs[b], causal=True, logits_soft_cap=8.0)
        close(o[rows], eo, f"request {b}")
        close(lse[rows], el, f"request {b} lse")
    # not causal within the request: is_causal=False, or window_right=-1 (no right bound)
    for kw in (dict(is_causal=False), dict(window_right=-1)):
        w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=q_len, **kw)
        o = w.run(q, cache)
        for b in range(3):
            rows = slice(b * q_len, (b + 1) * q_len)
            close(o[rows], R.attention(q[rows], ks[b], vs[b])[0], f"non-causal {kw}")


def test_multi_token_decode_errors():
    cache, indptr, indices, last, _, _ = _decode_case(kv_lens=(9, 2, 23))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=3)  # request 1 holds only 2 keys
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=0)
    with pytest.raises(NotImplementedError, match="window_right"):
        w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=2, window_right=3)
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=2)
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(torch.randn(6, 4, 32, dtype=DT), cache, q_len_per_req=3)
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(torch.randn(9, 4, 32, dtype=DT), cache)  # three rows a request, but two were planned


def test_failed_plan_keeps_the_previous_plan():
    """A plan() that raises leaves the last successful plan in force, whole (not an older one)."""
    cache, indptr, indices, last, ks, vs = _decode_case()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 32, 4)  # single-token plan
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=2)  # then a multi-token one
    with pytest.raises((TypeError, ValueError)):
        w.plan(indptr, indices, last, 4, 2, 32, 4, sm_scale="bad")
    q = torch.randn(6, 4, 32, dtype=DT)
    o = w.run(q, cache)  # the multi-token plan still runs
    for b in range(3):
        rows = slice(2 * b, 2 * b + 2)
        close(o[rows], R.attention(q[rows], ks[b], vs[b], causal=True)[0], f"request {b}")
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(torch.randn(3, 4, 32, dtype=DT), cache)  # the single-token plan is not revived


# ----------------------------------------------------------------------------- attention sinks
def _sink_ref(q, k, v, sinks, causal=False, sm_scale=None):
    """Float64 softmax with the sink logit appended to each row's denominator (FlashInfer's definition)."""
    qo, hq, d = q.shape
    kv, hkv, _ = k.shape
    group = hq // hkv
    scale = sm_scale if sm_scale is not None else 1 / math.sqrt(d)
    qd, kd, vd = (x.double().numpy() for x in (q, k, v))
    o = np.zeros((qo, hq, d))
    lse = np.zeros((qo, hq))
    for h in range(hq):
        for i in range(qo):
            js = [j for j in range(kv) if not causal or j <= i + kv - qo]
            s = np.array([qd[i, h] @ kd[j, h // group] * scale for j in js] + [float(sinks[h])])
            m = s.max()
            w = np.exp(s - m)
            o[i, h] = (w[:-1, None] * vd[js, h // group]).sum(0) / w.sum()
            lse[i, h] = (m + math.log(w.sum())) / math.log(2)
    return torch.from_numpy(o), torch.from_numpy(lse)


def test_sinks_decode_and_prefill():
    cache, indptr, indices, last, ks, vs = _decode_case()
    sinks = torch.randn(4) * 2
    q = torch.randn(3, 4, 32, dtype=DT)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 32, 4)
    o, lse = w.run(q, cache, sinks=sinks, return_lse=True)
    for b in range(3):
        eo, el = _sink_ref(q[b : b + 1], ks[b], vs[b], sinks)
        close(o[b], eo[0], f"decode {b}")
        close(lse[b], el[0], f"decode {b} lse")
    qp = torch.randn(7, 4, 32, dtype=DT)
    p = fi.BatchPrefillWithPagedKVCacheWrapper(ws())
    qo_indptr = i32(0, 2, 3, 7)
    p.plan(qo_indptr, indptr, indices, last, 4, 2, 32, 4, causal=True)
    o = p.run(qp, cache, sinks=sinks)
    for b in range(3):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        close(o[rows], _sink_ref(qp[rows], ks[b], vs[b], sinks, causal=True)[0], f"prefill {b}")
    with pytest.raises(ValueError, match="sinks"):
        p.run(qp, cache, sinks=torch.randn(3))


# ----------------------------------------------------------------------------- fast_decode_plan, _backend
def test_fast_decode_plan_sglang_form():
    """SGLang: begin_forward = partial(fast_decode_plan, wrapper), positional head, engine keywords."""
    cache, indptr, indices, last, ks, vs = _decode_case()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
    w._backend = "fa2"  # mini-sglang assigns it before CUDA-graph capture
    assert w._backend == "fa2"
    w.begin_forward = functools.partial(fi.decode.fast_decode_plan, w)
    w.begin_forward(
        indptr,
        indices,
        last,
        4,
        2,
        32,
        4,
        "NONE",
        -1,
        None,
        data_type=DT,
        q_data_type=DT,
        non_blocking=True,
        fixed_split_size=None,
        disable_split_kv=True,
        global_override_indptr_cpu=indptr.clone(),
    )
    q = torch.randn(3, 4, 32, dtype=DT)
    o = w.run(q, cache)
    for b in range(3):
        close(o[b], R.attention(q[b : b + 1], ks[b], vs[b])[0][0], f"request {b}")
    with pytest.raises(ValueError, match="global_override_indptr_cpu"):
        fi.decode.fast_decode_plan(w, indptr, indices, last, 4, 2, 32, 4, global_override_indptr_cpu=indptr[:2])
    with pytest.raises(TypeError, match="_backend"):
        w._backend = 3


# ----------------------------------------------------------------------------- rejected parameters
def _paged_plan(**kw):
    _, indptr, indices, last, _, _ = _decode_case()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws())
    w.plan(i32(0, 1, 2, 3), indptr, indices, last, 4, 2, 32, 4, **kw)
    return w


def _ragged_plan(**kw):
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws())
    w.plan(i32(0, 1, 3), i32(0, 4, 9), 4, 2, 32, **kw)
    return w


def _decode_run(**kw):
    cache, indptr, indices, last, _, _ = _decode_case()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 32, 4)
    return w.run(torch.randn(3, 4, 32, dtype=DT), cache, **kw)


def _paged_run(**kw):
    cache, _, _, _, _, _ = _decode_case()
    return _paged_plan().run(torch.randn(3, 4, 32, dtype=DT), cache, **kw)


def _decode_run_positional(*args):
    cache, indptr, indices, last, _, _ = _decode_case()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 32, 4)
    return w.run(torch.randn(3, 4, 32, dtype=DT), cache, *args)


def _paged_run_positional(*args):
    cache, _, _, _, _, _ = _decode_case()
    return _paged_plan().run(torch.randn(3, 4, 32, dtype=DT), cache, *args)


REJECTED = [
    ("prefix_len_ptr", lambda: _paged_plan(prefix_len_ptr=i32(0, 0, 0)), NotImplementedError),
    ("token_pos_in_items_ptr", lambda: _ragged_plan(token_pos_in_items_ptr=i32(0)), NotImplementedError),
    ("token_pos_in_items_len", lambda: _paged_plan(token_pos_in_items_len=4), NotImplementedError),
    ("max_item_len_ptr", lambda: _ragged_plan(max_item_len_ptr=i32(1, 1)), NotImplementedError),
    ("v_indptr", lambda: _ragged_plan(v_indptr=i32(0, 5, 9)), NotImplementedError),
    ("o_indptr", lambda: _ragged_plan(o_indptr=i32(0, 2, 3)), NotImplementedError),
    ("max_token_per_sequence", lambda: _paged_plan(max_token_per_sequence=0), ValueError),
    ("max_sequence_kv", lambda: _paged_plan(max_sequence_kv=10), ValueError),
    ("uniform_q_len", lambda: _ragged_plan(uniform_q_len=1), ValueError),
    ("seq_lens_q", lambda: _paged_plan(seq_lens_q=i32(1, 1, 2)), ValueError),
    ("jit_args", lambda: fi.BatchDecodeWithPagedKVCacheWrapper(ws(), jit_args=["x"]), NotImplementedError),
    ("jit_kwargs", lambda: fi.BatchPrefillWithPagedKVCacheWrapper(ws(), jit_kwargs={}), NotImplementedError),
    (
        "variant_owns_mask",
        lambda: fi.BatchPrefillWithRaggedKVCacheWrapper(ws(), variant_owns_mask=True),
        NotImplementedError,
    ),
    ("kv_cache_sf", lambda: _decode_run(kv_cache_sf=torch.zeros(1)), NotImplementedError),
    (
        "skip_softmax_threshold_scale_factor",
        lambda: _paged_run(skip_softmax_threshold_scale_factor=0.5),
        NotImplementedError,
    ),
    ("use_fp16_softmax", lambda: _paged_run(use_fp16_softmax=True), NotImplementedError),
    ("uses_spcompress", lambda: _paged_run(uses_spcompress=True), NotImplementedError),
    ("kv_cache_sf", lambda: fi.single_prefill_with_kv_cache(*_qkv(), kv_cache_sf=torch.zeros(1)), NotImplementedError),
    ("lse_base", lambda: _decode_run(return_lse=True, lse_base="10"), ValueError),
    ("lse_layout", lambda: _paged_run(return_lse=True, lse_layout="HNX"), ValueError),
    ("max_q_len", lambda: _paged_plan(max_q_len=4), TypeError),
    (
        "window_right",
        lambda: fi.BatchDecodeWithPagedKVCacheWrapper(ws()).plan(*_decode_case()[1:4], 4, 2, 32, 4, window_right=3),
        NotImplementedError,
    ),
    (r"\*args", lambda: _decode_run_positional(torch.zeros(3, dtype=torch.int32)), NotImplementedError),
    (r"\*args", lambda: _paged_run_positional(0.5, 1.0, False, "x"), NotImplementedError),
    (
        "q_len_per_req",
        lambda: fi.BatchDecodeWithPagedKVCacheWrapper(ws()).plan(*_decode_case()[1:4], 4, 2, 32, 4, q_len_per_req=1.5),
        ValueError,
    ),
]


def _qkv():
    torch.manual_seed(1)
    return torch.randn(3, 4, 32, dtype=DT), torch.randn(5, 2, 32, dtype=DT), torch.randn(5, 2, 32, dtype=DT)


@pytest.mark.parametrize("name,fn,exc", REJECTED, ids=[f"{i}-{c[0]}" for i, c in enumerate(REJECTED)])
def test_unsupported_or_inconsistent_parameter_is_named(name, fn, exc):
    with pytest.raises(exc, match=name):
        fn()


# FlashInfer 0.7.2's parameters that select features this package does not have, with 0.7.2's defaults: a
# non-default value is refused by name (REJECTED above has a case for each), the default passed explicitly is
# accepted and changes nothing.
REFUSED_072 = {
    "jit_args": None,
    "jit_kwargs": None,
    "variant_owns_mask": False,
    "prefix_len_ptr": None,
    "token_pos_in_items_ptr": None,
    "token_pos_in_items_len": 0,
    "max_item_len_ptr": None,
    "v_indptr": None,
    "o_indptr": None,
    "kv_cache_sf": None,
    "skip_softmax_threshold_scale_factor": None,
    "use_fp16_softmax": None,
    "uses_spcompress": None,
    "window_right": 0,
}


def test_every_refused_072_parameter_has_a_rejection_case():
    assert set(REFUSED_072) <= {name for name, _, _ in REJECTED}, set(REFUSED_072) - {n for n, _, _ in REJECTED}


def test_refused_072_parameters_accept_their_defaults():
    d = REFUSED_072
    cache, indptr, indices, last, ks, vs = _decode_case()
    q = torch.randn(3, 4, 32, dtype=DT)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws(), jit_args=d["jit_args"])
    w.plan(indptr, indices, last, 4, 2, 32, 4, window_right=d["window_right"])
    o = w.run(q, cache, kv_cache_sf=d["kv_cache_sf"],
              skip_softmax_threshold_scale_factor=d["skip_softmax_threshold_scale_factor"])  # fmt: skip
    close(o, R.batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last)[0], "decode")

    extras = {
        k: d[k] for k in ("prefix_len_ptr", "token_pos_in_items_ptr", "token_pos_in_items_len", "max_item_len_ptr")
    }
    init = {k: d[k] for k in ("jit_args", "jit_kwargs", "variant_owns_mask")}
    qo = i32(0, 1, 2, 3)
    p = fi.BatchPrefillWithPagedKVCacheWrapper(ws(), **init)
    p.plan(qo, indptr, indices, last, 4, 2, 32, 4, causal=True, **extras)
    o = p.run(q, cache, **{k: d[k] for k in ("kv_cache_sf", "skip_softmax_threshold_scale_factor",
                                             "use_fp16_softmax", "uses_spcompress")})  # fmt: skip
    exp = R.batch_prefill_with_paged_kv_cache(q, qo, cache, indptr, indices, last, causal=True)[0]
    close(o, exp, "paged prefill")

    qkv = _qkv()
    r = fi.BatchPrefillWithRaggedKVCacheWrapper(ws(), **init)
    r.plan(i32(0, 3), i32(0, 5), 4, 2, 32, causal=True, v_indptr=d["v_indptr"], o_indptr=d["o_indptr"], **extras)
    o = r.run(*qkv, kv_cache_sf=d["kv_cache_sf"])
    exp = R.single_prefill_with_kv_cache(*qkv, causal=True)
    close(o, exp, "ragged prefill")
    close(fi.single_prefill_with_kv_cache(*qkv, causal=True, kv_cache_sf=d["kv_cache_sf"]), exp, "single prefill")


def test_batch_descriptions_accepted_when_consistent():
    """max_token_per_sequence, max_sequence_kv, uniform_q_len, seq_lens_q, block_tables: checked, then used."""
    cache, indptr, indices, last, ks, vs = _decode_case()
    qo = i32(0, 2, 4, 6)
    kv_lens = fi.get_seq_lens(indptr, last, 4)
    table = torch.zeros(3, 6, dtype=torch.int32)
    for b in range(3):
        n = int(indptr[b + 1] - indptr[b])
        table[b, :n] = indices[int(indptr[b]) : int(indptr[b + 1])]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws())
    q = torch.randn(6, 4, 32, dtype=DT)
    w.plan(qo, None, None, None, 4, 2, 32, 4, block_tables=table, seq_lens=kv_lens, causal=True,
           max_token_per_sequence=2, max_sequence_kv=23, uniform_q_len=2, seq_lens_q=i32(2, 2, 2))  # fmt: skip
    o = w.run(q, cache)
    for b in range(3):
        close(o[2 * b : 2 * b + 2], R.attention(q[2 * b : 2 * b + 2], ks[b], vs[b], causal=True)[0], f"request {b}")
    wrong = table.clone()
    wrong[0, 0] = int(table[0, 1])
    with pytest.raises(ValueError, match="block_tables"):
        w.plan(qo, indptr, indices, last, 4, 2, 32, 4, block_tables=wrong, seq_lens=kv_lens)


# ----------------------------------------------------------------------------- cascade: a bad level
def test_cascade_empty_level_qo_indptr_leaves_plan():
    cache, indptr, indices, last, ks, vs = _decode_case()
    w = fi.MultiLevelCascadeAttentionWrapper(2, ws())
    qo = [i32(0, 3), i32(0, 1, 2, 3)]
    shared = [i32(0, 1), i32(int(indices[0]))]
    args = ([qo[0], qo[1]], [shared[0], indptr], [shared[1], indices], [i32(4), last], 4, 2, 32, 4)
    w.plan(*args)
    q = torch.randn(3, 4, 32, dtype=DT)
    before = w.run(q, cache)
    for bad in (torch.empty(0, dtype=torch.int32), i32(0)):
        with pytest.raises(ValueError, match=r"qo_indptr_arr\[1\]"):
            w.plan([qo[0], bad], *args[1:])
    close(w.run(q, cache), before, "the earlier plan still runs", atol=0)


# ----------------------------------------------------------------------------- import without CUDA
def test_import_does_not_initialise_cuda():
    """mini-sglang asserts it: importing the package (and as_flashinfer()) must leave CUDA untouched."""
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "torch.cuda._lazy_init = lambda *a, **k: calls.append(1)\n"
        "import flashinfer_triton\n"
        "flashinfer_triton.as_flashinfer()\n"
        "import flashinfer, flashinfer.decode, flashinfer.prefill, flashinfer.cascade, flashinfer.page\n"
        "assert not calls, 'torch.cuda initialisation requested during import'\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


# ----------------------------------------------------------------------------- ALiBi with soft cap, kernels
def _alibi_cap_expected(q, k, v, cap, scale):
    """float64 FlashInfer order: s = cap * tanh(scale * (q.k * scale + slope * (j - i)) / cap)."""
    qo, hq, _ = q.shape
    kv, hkv, _ = k.shape
    slopes = R.alibi_slopes(hq).double()
    qd, kd, vd = q.double(), k.double().repeat_interleave(hq // hkv, 1), v.double().repeat_interleave(hq // hkv, 1)
    i = torch.arange(qo)[:, None] + 0.0
    j = torch.arange(kv)[None, :] + 0.0
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale + slopes[:, None, None] * (j - i)[None]
    s = cap * torch.tanh(s * scale / cap)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd)


@pytest.mark.interpret
@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")
def test_alibi_soft_cap_kernels():
    torch.manual_seed(4)
    q, k, v = torch.randn(5, 4, 32, dtype=DT), torch.randn(9, 2, 32, dtype=DT), torch.randn(9, 2, 32, dtype=DT)
    cap, scale = 3.0, 0.4
    o = fi.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ALIBI", logits_soft_cap=cap, sm_scale=scale)
    close(o, _alibi_cap_expected(q, k, v, cap, scale), "prefill kernel")
    od = fi.single_decode_with_kv_cache(q[0], k, v, pos_encoding_mode="ALIBI", logits_soft_cap=cap, sm_scale=scale)
    close(od, _alibi_cap_expected(q[:1], k, v, cap, scale)[0], "decode kernel")


@pytest.mark.interpret
@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")
def test_multi_token_decode_and_sinks_kernels():
    cache, indptr, indices, last, ks, vs = _decode_case(kv_lens=(9, 4, 13))
    sinks = torch.randn(4)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=2)
    q = torch.randn(6, 4, 32, dtype=DT)
    o = w.run(q, cache, sinks=sinks)
    for b in range(3):
        rows = slice(2 * b, 2 * b + 2)
        close(o[rows], _sink_ref(q[rows], ks[b], vs[b], sinks, causal=True)[0], f"request {b}")


def test_lse_base_on_single_decode_and_cascade():
    """lse_base="ln" on the other entry points that return an LSE: natural log = base-2 value * ln 2."""
    torch.manual_seed(6)
    q, k, v = torch.randn(4, 32, dtype=DT), torch.randn(7, 2, 32, dtype=DT), torch.randn(7, 2, 32, dtype=DT)
    _, l2 = fi.single_decode_with_kv_cache(q, k, v, return_lse=True)
    _, le = fi.single_decode_with_kv_cache(q, k, v, return_lse=True, lse_base="ln")
    close(le, R.single_decode_with_kv_cache(q, k, v, return_lse=True)[1] * math.log(2), "single decode")
    close(le, l2 * math.log(2), "single decode vs base 2", atol=1e-5)
    cache, indptr, indices, last, _, _ = _decode_case()
    w = fi.MultiLevelCascadeAttentionWrapper(1, ws())
    w.plan([i32(0, 1, 2, 3)], [indptr], [indices], [last], 4, 2, 32, 4)
    qb = torch.randn(3, 4, 32, dtype=DT)
    _, lb = w.run(qb, cache, True)
    _, le = w.run(qb, cache, True, lse_base="ln")
    close(le, lb * math.log(2), "cascade", atol=1e-5)


def test_multi_token_decode_cuda_graph_buffers():
    """CUDA-graph wrappers: the multi-token plan refills the caller's buffers; q_len_per_req is then frozen."""
    cache, indptr, indices, last, ks, vs = _decode_case()
    bufs = (torch.zeros(4, dtype=torch.int32), torch.zeros(64, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), *bufs)
    for seed in (0, 1):  # a second plan() of the same wrapper, as every engine step
        torch.manual_seed(seed)
        w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=2)
        q = torch.randn(6, 4, 32, dtype=DT)
        o = w.run(q, cache)
        for b in range(3):
            rows = slice(2 * b, 2 * b + 2)
            close(o[rows], R.attention(q[rows], ks[b], vs[b], causal=True)[0], f"step {seed} request {b}")
    assert torch.equal(bufs[0], indptr) and torch.equal(bufs[2], last)
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=3)


# ----------------------------------------------------------------------------- FlashInfer 0.7.2's wrapper members
# Every public member (method, property, attribute) of FlashInfer 0.7.2's wrappers, read from its sources.
MEMBERS_072 = {
    "BatchDecodeWithPagedKVCacheWrapper": "begin_forward device forward forward_return_lse is_cuda_graph_enabled "
    "plan prewarm_paged_kv_stride_variant reset_workspace_buffer resolved_backend run run_return_lse "
    "use_tensor_cores workspace_size _backend",
    "BatchPrefillWithPagedKVCacheWrapper": "begin_forward device forward forward_return_lse is_cuda_graph_enabled "
    "plan prewarm_paged_kv_stride_variant reset_workspace_buffer run run_return_lse workspace_size _backend",
    "BatchPrefillWithRaggedKVCacheWrapper": "begin_forward device forward forward_return_lse is_cuda_graph_enabled "
    "plan reset_workspace_buffer run run_return_lse _backend",
    "MultiLevelCascadeAttentionWrapper": "begin_forward forward is_cuda_graph_enabled plan "
    "prewarm_paged_kv_stride_variant reset_workspace_buffer run",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper": "begin_forward forward reset_workspace_buffer",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper": "begin_forward forward prewarm_paged_kv_stride_variant "
    "reset_workspace_buffer",
}


def _wrappers():
    graph = (i32(0, 0, 0, 0), torch.zeros(64, dtype=torch.int32), i32(0, 0, 0))
    return {
        "BatchDecodeWithPagedKVCacheWrapper": fi.BatchDecodeWithPagedKVCacheWrapper(ws()),
        "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), *graph),
        "BatchPrefillWithPagedKVCacheWrapper": fi.BatchPrefillWithPagedKVCacheWrapper(ws()),
        "BatchPrefillWithRaggedKVCacheWrapper": fi.BatchPrefillWithRaggedKVCacheWrapper(ws()),
        "MultiLevelCascadeAttentionWrapper": fi.MultiLevelCascadeAttentionWrapper(2, ws()),
        "BatchDecodeWithSharedPrefixPagedKVCacheWrapper": fi.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws()),
        "BatchPrefillWithSharedPrefixPagedKVCacheWrapper": fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws()),
    }


def test_every_flashinfer_072_wrapper_member_exists():
    for name, w in _wrappers().items():
        members = MEMBERS_072[name.replace("CUDAGraph", "")].split()
        missing = [m for m in members if not hasattr(w, m)]
        assert not missing, f"{name} lacks {missing}"
    # workspace_size takes plan()'s arguments in FlashInfer 0.7.2's order
    import inspect

    dec = list(inspect.signature(fi.BatchDecodeWithPagedKVCacheWrapper.workspace_size).parameters)[1:]
    assert dec == list(inspect.signature(fi.BatchDecodeWithPagedKVCacheWrapper.plan).parameters)[1:18] + [
        "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req",
    ]  # fmt: skip
    pre = list(inspect.signature(fi.BatchPrefillWithPagedKVCacheWrapper.workspace_size).parameters)[1:]
    assert pre[:10] == [
        "qo_indptr",
        "paged_kv_indptr",
        "paged_kv_indices",
        "paged_kv_last_page_len",
        "num_qo_heads",
        "num_kv_heads",
        "head_dim_qk",
        "page_size",
        "head_dim_vo",
        "custom_mask",
    ]
    assert pre[-4:] == ["max_sequence_kv", "fixed_split_size", "disable_split_kv", "uniform_q_len"]  # fmt: skip


def test_device_resolved_backend_and_prewarm():
    cache, indptr, indices, last, ks, vs = _decode_case()
    buf = ws()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(buf)
    assert w.device == buf.device
    assert fi.BatchPrefillWithRaggedKVCacheWrapper(buf).device == buf.device
    assert w.resolved_backend == "auto"  # before the first plan, as in FlashInfer
    with pytest.raises(RuntimeError, match="plan"):
        w.prewarm_paged_kv_stride_variant()
    w.plan(indptr, indices, last, 4, 2, 32, 4)
    assert w.resolved_backend == ("triton" if INTERPRET else "torch")
    w.prewarm_paged_kv_stride_variant("independent")
    with pytest.raises(ValueError, match="variant"):
        w.prewarm_paged_kv_stride_variant("shared")
    w._backend = "fa2"  # an explicit backend reports itself
    assert w.resolved_backend == "fa2"
    assert fi.BatchDecodeWithPagedKVCacheWrapper(buf, backend="fa3").resolved_backend == "fa3"
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_len_per_req=2)  # the multi-token core's plan counts
    w.prewarm_paged_kv_stride_variant()
    p = fi.BatchPrefillWithPagedKVCacheWrapper(buf)
    c = fi.MultiLevelCascadeAttentionWrapper(1, buf)
    s = fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(buf)
    for x in (p, c, s):
        with pytest.raises(RuntimeError, match="plan"):
            x.prewarm_paged_kv_stride_variant()
    qo = i32(0, 2, 3, 5)
    p.plan(qo, indptr, indices, last, 4, 2, 32, 4)
    c.plan([qo], [indptr], [indices], [last], 4, 2, 32, 4)
    s.begin_forward(qo, indptr, indices, last, 4, 2, 32, 4)
    for x in (p, c, s):
        x.prewarm_paged_kv_stride_variant()
        with pytest.raises(TypeError, match="variant"):
            x.prewarm_paged_kv_stride_variant(1)


def test_workspace_size_leaves_the_wrapper_alone():
    """workspace_size() plans on a probe: the wrapper's plan, its CUDA-graph buffers and its results stay."""
    cache, indptr, indices, last, ks, vs = _decode_case()
    bufs = (torch.full((4,), 9, dtype=torch.int32), torch.full((64,), 9, dtype=torch.int32),
            torch.full((3,), 9, dtype=torch.int32))  # fmt: skip
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), *bufs)
    f, i = w.workspace_size(indptr, indices, last, 4, 2, 32, 4)
    assert all(bool((b == 9).all()) for b in bufs) and w.plan_info() is None
    assert isinstance(f, int) and isinstance(i, int) and 0 <= f <= WS and i >= 0
    w.plan(indptr, indices, last, 4, 2, 32, 4)
    plan_id = w.plan_info().plan_id
    w.workspace_size(indptr, indices, last, 8, 8, 64, 4, logits_soft_cap=5.0)
    assert w.plan_info().plan_id == plan_id
    q = torch.randn(3, 4, 32, dtype=DT)
    o = w.run(q, cache)
    for b in range(3):
        close(o[b : b + 1], R.attention(q[b : b + 1], ks[b], vs[b])[0], f"request {b}")
    with pytest.raises(ValueError, match="page_size"):
        w.workspace_size(indptr, indices, last, 4, 2, 32, 0)
    qo = i32(0, 2, 3, 5)
    p = fi.BatchPrefillWithPagedKVCacheWrapper(ws())
    f, i = p.workspace_size(qo, indptr, indices, last, 4, 2, 32, 4, causal=True)
    assert p.plan_info() is None and 0 <= f <= WS and i >= 0


def _workspace_size_is_what_plan_uses(dev, kv_lens, ws_bytes):
    """A float workspace of the reported size gets the same split-KV plan (and right results); in CUDA-graph
    mode the reported int size plans and 4 bytes less is refused by plan() itself."""
    cache, indptr, indices, last, ks, vs = _decode_case(kv_lens=kv_lens)
    cache, ks, vs = cache.to(dev), [k.to(dev) for k in ks], [v.to(dev) for v in vs]
    nb = len(kv_lens)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(ws_bytes, dtype=torch.uint8, device=dev))
    f, i = w.workspace_size(indptr, indices, last, 4, 2, 32, 4)
    assert f > 256 and i == 0  # this batch splits its long request; eager work lists are fresh arrays
    w2 = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(f, dtype=torch.uint8, device=dev))
    w2.plan(indptr, indices, last, 4, 2, 32, 4)
    assert w2.plan_info().float_workspace_bytes == f - 256
    q = torch.randn(nb, 4, 32, dtype=DT, device=dev)
    o = w2.run(q, cache)
    for b in range(nb):
        close(o[b : b + 1], R.attention(q[b : b + 1], ks[b], vs[b])[0], f"request {b}")
    z = functools.partial(torch.zeros, dtype=torch.int32, device=dev)
    bufs = (z(nb + 1), z(int(indptr[-1]) + 8), z(nb))
    g = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(ws_bytes, dtype=torch.uint8, device=dev), *bufs)
    qo = torch.arange(nb + 1, dtype=torch.int32) * 2
    gp = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(ws_bytes, dtype=torch.uint8, device=dev),
                                                use_cuda_graph=True, qo_indptr_buf=z(nb + 1),
                                                paged_kv_indptr_buf=bufs[0].clone(),
                                                paged_kv_indices_buf=bufs[1].clone(),
                                                paged_kv_last_page_len_buf=bufs[2].clone())  # fmt: skip
    plans = [(g, (indptr, indices, last, 4, 2, 32, 4), {}),
             (gp, (qo, indptr, indices, last, 4, 2, 32, 4), {"causal": True})]  # fmt: skip
    for x, args, kw in plans:
        f, i = x.workspace_size(*args, **kw)
        assert i > 0
        x.reset_workspace_buffer(x._float_workspace_buffer, torch.empty(i, dtype=torch.uint8, device=dev))
        x.plan(*args, **kw)
        x.reset_workspace_buffer(x._float_workspace_buffer, torch.empty(i - 4, dtype=torch.uint8, device=dev))
        with pytest.raises(ValueError, match="int_workspace_buffer"):
            x.plan(*args, **kw)


@pytest.mark.interpret
@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels' plans in the interpreter (TRITON_INTERPRET=1)")
def test_workspace_size_is_what_plan_uses():
    _workspace_size_is_what_plan_uses("cpu", (300, 7, 65), WS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_workspace_size_is_what_plan_uses_gpu():
    _workspace_size_is_what_plan_uses("cuda", (3000, 7, 650, 9), 128 << 20)
