"""flashinfer_triton.flash_attn against a float32 reference written from flash-attn 2.x's documented semantics.

The reference is independent of the library: bottom-right causal alignment, ``window_size=(left, right)``,
softcap, ALiBi as ``-slope * |i + seqlen_k - seqlen_q - j|``, and the natural-log LSE.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashinfer_triton.flash_attn as fa
from conftest import DEVICE as DEV
from conftest import assert_close
from flashinfer_triton import host_caches
from flashinfer_triton.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from helpers import block_table

DT = torch.float16


def ref_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """One sequence, flash-attn semantics: ``q [sq, H, D]``, ``k, v [sk, Hk, D]`` -> (o [sq, H, D], lse [H, sq])."""
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    slopes = None if slopes is None else slopes.cpu()
    sq, h, d = q.shape
    sk, hk, _ = k.shape
    scale = d**-0.5 if scale is None else scale
    kf = k.float().repeat_interleave(h // hk, 1)
    vf = v.float().repeat_interleave(h // hk, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    if slopes is not None:
        s = s - slopes.float()[:, None, None] * (diag - j).abs().float()[None]
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vf), lse


def std_slopes(h):
    return torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], dtype=torch.float32, device=DEV)


CASES = [
    dict(causal=False),
    dict(causal=True),
    dict(causal=True, window=(5, -1)),
    dict(causal=False, window=(4, -1)),
    dict(causal=False, window=(3, 0)),
    dict(causal=True, softcap=5.0),
    dict(causal=True, alibi=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_flash_attn_func_matches_reference(case):
    b, sq, sk, h, hk, d = 2, 7, 19, 4, 2, 32
    q = torch.randn(b, sq, h, d).to(DEV, DT)
    k, v = torch.randn(b, sk, hk, d).to(DEV, DT), torch.randn(b, sk, hk, d).to(DEV, DT)
    slopes = std_slopes(h) if case.get("alibi") else None
    out, lse, probs = flash_attn_func(
        q, k, v, 0.0, 0.3, case["causal"], case.get("window", (-1, -1)), case.get("softcap", 0.0), slopes,
        False, True,
    )  # fmt: skip
    assert probs is None
    assert out.shape == q.shape and out.dtype == DT and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    for i in range(b):
        o_ref, s_ref = ref_attention(
            q[i], k[i], v[i], case["causal"], case.get("window", (-1, -1)), case.get("softcap", 0.0), slopes, 0.3
        )
        assert_close(out[i], o_ref)
        assert_close(lse[i], s_ref, atol=2e-3, rtol=2e-3, name="lse")
    plain = flash_attn_func(q, k, v, softmax_scale=0.3, causal=case["causal"], window_size=case.get("window", (-1, -1)),
                            softcap=case.get("softcap", 0.0), alibi_slopes=slopes)  # fmt: skip
    assert torch.equal(plain, out)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def test_flash_attn_varlen_func_ragged_and_paged():
    h, hk, d, page = 4, 1, 16, 8
    q_lens, k_lens = [3, 1, 6], [9, 17, 6]
    q = torch.randn(sum(q_lens), h, d).to(DEV, DT)
    k, v = torch.randn(sum(k_lens), hk, d).to(DEV, DT), torch.randn(sum(k_lens), hk, d).to(DEV, DT)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 17, causal=True, return_attn_probs=True)
    assert lse.shape == (h, sum(q_lens))
    # the same keys in a paged cache, pages in a shuffled order
    table, num_blocks = block_table(k_lens, page, max_blocks=3, spare_blocks=3, seed=None, device=DEV)
    k_cache = torch.randn(num_blocks, page, hk, d).to(DEV, DT)
    v_cache = torch.randn(num_blocks, page, hk, d).to(DEV, DT)
    for r, n in enumerate(k_lens):
        for t in range(n):
            k_cache[table[r, t // page], t % page] = k[int(cu_k[r]) + t]
            v_cache[table[r, t // page], t % page] = v[int(cu_k[r]) + t]
    out_p, lse_p, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, 6, 17, causal=True, return_attn_probs=True, block_table=table
    )
    for r in range(3):
        qs, qe, ks, ke = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        o_ref, s_ref = ref_attention(q[qs:qe], k[ks:ke], v[ks:ke], causal=True)
        for o, s in ((out, lse), (out_p, lse_p)):
            assert_close(o[qs:qe], o_ref)
            assert_close(s[:, qs:qe], s_ref, atol=2e-3, rtol=2e-3, name="lse")


def test_varlen_alibi_lse_and_plan_cache():
    h, hk, d = 4, 2, 16
    q_lens, k_lens = [2, 5], [11, 5]
    q = torch.randn(7, h, d).to(DEV, DT)
    k, v = torch.randn(16, hk, d).to(DEV, DT), torch.randn(16, hk, d).to(DEV, DT)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    fa.clear_plans()
    slopes = std_slopes(h)
    plan_ids = set()
    for _ in range(3):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 11, causal=True, alibi_slopes=slopes,
                                             return_attn_probs=True)  # fmt: skip
        plan_ids.update(e.plan_id for e in host_caches()["flash_attn"])
    builds = host_caches()["flash_attn"]
    assert len(builds) == 1 and len(plan_ids) == 1  # the same index tensors: planned once
    for r in range(2):
        qs, qe, ks, ke = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        o_ref, s_ref = ref_attention(q[qs:qe], k[ks:ke], v[ks:ke], causal=True, slopes=slopes)
        assert_close(out[qs:qe], o_ref)
        assert_close(lse[:, qs:qe], s_ref, atol=2e-3, rtol=2e-3, name="lse")
    # lengths changed in place: the version counter moves, so the call re-plans
    cu_k[1:] = _cu([16, 0])[1:]
    out2 = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 16, causal=True)
    assert len(host_caches()["flash_attn"]) == 2
    o_ref, _ = ref_attention(q[:2], k, v, causal=True)
    assert_close(out2[:2], o_ref)
    assert bool((out2[2:] == 0).all())  # rows with no visible key are zero, as flash-attn writes them


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sq", [1, 3])
def test_flash_attn_with_kvcache_appends_and_attends(paged, sq):
    b, h, hk, d, s_new = 3, 4, 2, 16, 2
    cached = torch.tensor([5, 0, 12], dtype=torch.int32, device=DEV)
    q = torch.randn(b, sq, h, d).to(DEV, DT)
    k_new, v_new = torch.randn(b, s_new, hk, d).to(DEV, DT), torch.randn(b, s_new, hk, d).to(DEV, DT)
    if paged:
        page, max_blocks = 4, 4
        k_cache = torch.randn(16, page, hk, d).to(DEV, DT)
        v_cache = torch.randn(16, page, hk, d).to(DEV, DT)
        table, _ = block_table([page * max_blocks] * b, page, spare_blocks=16 - b * max_blocks, seed=None, device=DEV)
        kw = dict(block_table=table)

        def row(cache, r):  # the dense view of sequence r
            return cache[table[r].long()].reshape(-1, hk, d)
    else:
        k_cache = torch.randn(5, 16, hk, d).to(DEV, DT)
        v_cache = torch.randn(5, 16, hk, d).to(DEV, DT)
        batch_idx = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEV)
        kw = dict(cache_batch_idx=batch_idx)

        def row(cache, r):
            return cache[int(batch_idx[r])]

    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached, causal=True, return_softmax_lse=True, **kw
    )
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    for r in range(b):
        n = int(cached[r])
        kr, vr = row(k_cache, r), row(v_cache, r)
        # appended in place, nothing else written
        assert torch.equal(kr[n : n + s_new], k_new[r]) and torch.equal(vr[n : n + s_new], v_new[r])
        for now, before in ((kr, row(k_before, r)), (vr, row(v_before, r))):
            assert torch.equal(now[:n], before[:n]) and torch.equal(now[n + s_new :], before[n + s_new :])
        o_ref, s_ref = ref_attention(q[r], kr[: n + s_new], vr[: n + s_new], causal=True)
        assert_close(out[r], o_ref)
        assert_close(lse[r], s_ref, atol=2e-3, rtol=2e-3, name="lse")
    # a decode loop: the caller advances cache_seqlens in place; the next call sees the new lengths
    cached += s_new
    out2 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cached, causal=True, **kw)
    for r in range(b):
        n = int(cached[r])
        o_ref, _ = ref_attention(q[r], row(k_cache, r)[:n], row(v_cache, r)[:n], causal=True)
        assert_close(out2[r], o_ref)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.1), "dropout_p"),
        (lambda q, k, v: flash_attn_func(q, k, v, window_size=(-1, 3)), "window_size"),
        (lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=std_slopes(4)), "alibi_slopes"),
        (lambda q, k, v: flash_attn_func(q, k, v, causal=True, alibi_slopes=std_slopes(4) * 2), "alibi_slopes"),
        (lambda q, k, v: flash_attn_with_kvcache(q, k, v, rotary_cos=torch.ones(8, 4, device=DEV)), "rotary_cos"),
        (lambda q, k, v: flash_attn_with_kvcache(q, k, v, cache_leftpad=torch.ones(2, device=DEV)), "cache_leftpad"),
        (lambda q, k, v: flash_attn_with_kvcache(q, k, v, k=k[:, :1], v=v[:, :1]), "cache_seqlens"),
        (lambda q, k, v: flash_attn_with_kvcache(q, k, v, k=k[:, :1]), "v"),
        (lambda q, k, v: flash_attn_func(q, k[:, :, :1, :8], v[:, :, :1, :8]), "k"),
    ],
)
def test_unsupported_or_bad_arguments_are_named(call, match):
    q = torch.randn(2, 3, 4, 16).to(DEV, DT)
    k, v = torch.randn(2, 8, 2, 16).to(DEV, DT), torch.randn(2, 8, 2, 16).to(DEV, DT)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, v)


def test_bad_option_leaves_the_cache_unwritten():
    q = torch.randn(2, 1, 4, 16).to(DEV, DT)
    k_cache, v_cache = torch.randn(2, 8, 2, 16).to(DEV, DT), torch.randn(2, 8, 2, 16).to(DEV, DT)
    before = k_cache.clone()
    k_new = torch.randn(2, 1, 2, 16).to(DEV, DT)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=3, window_size=(2, 5))
    assert torch.equal(k_cache, before)


def test_lse_is_natural_log():
    q = torch.randn(1, 1, 1, 16).to(DEV, DT)
    k = torch.randn(1, 1, 1, 16).to(DEV, DT).expand(1, 4, 1, 16).contiguous()  # four equal scores: lse = s + ln(4)
    v = torch.randn(1, 4, 1, 16).to(DEV, DT)
    _, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    score = float((q.float() * k[:, :1].float()).sum()) / 4.0
    assert abs(float(lse) - (score + math.log(4))) < 1e-3


@pytest.mark.parametrize("sq", [1, 4])
def test_flash_attn_with_kvcache_alibi_softcap_window(sq):
    b, h, hk, d = 2, 4, 2, 16
    cached = torch.tensor([9, 14], dtype=torch.int32, device=DEV)
    q = torch.randn(b, sq, h, d).to(DEV, DT)
    k_cache, v_cache = torch.randn(b, 24, hk, d).to(DEV, DT), torch.randn(b, 24, hk, d).to(DEV, DT)
    slopes = std_slopes(h)
    for kw in (dict(alibi_slopes=slopes), dict(softcap=3.0, window_size=(6, 0))):
        out, lse = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cached, causal=True, return_softmax_lse=True, **kw
        )
        for r in range(b):
            n = int(cached[r])
            o_ref, s_ref = ref_attention(q[r], k_cache[r, :n], v_cache[r, :n], causal=True,
                                         window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                                         slopes=kw.get("alibi_slopes"))  # fmt: skip
            assert_close(out[r], o_ref)
            assert_close(lse[r], s_ref, atol=2e-3, rtol=2e-3, name="lse")


def test_host_index_tensors_changed_outside_pytorch_replan():
    """A host cu_seqlens whose values change without PyTorch seeing it (through numpy) gets a new plan."""
    import numpy as np

    q = torch.randn(8, 2, 16).to("cpu", DT)  # the host path: index tensors on the host, as numpy shares them
    k, v = torch.randn(8, 2, 16).to("cpu", DT), torch.randn(8, 2, 16).to("cpu", DT)
    npq = np.array([0, 4, 8], np.int32)
    cu = torch.from_numpy(npq)
    flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)
    npq[1] = 2  # the tensor's version counter does not move
    got = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    for b, (s, e) in enumerate(((0, 2), (2, 8))):
        o_ref, _ = ref_attention(q[s:e], k[s:e], v[s:e], causal=True)
        assert_close(got[s:e], o_ref, name=f"request {b}")
