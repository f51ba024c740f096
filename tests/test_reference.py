"""The reference is the spec: checked against independent code, on the CPU, in a few seconds.

Independent code here means ``torch.nn.functional.scaled_dot_product_attention`` (with masks built in
this file), ``numpy.packbits``, and float64 loops in plain Python/numpy written from SPEC.md, never the
reference's own helpers. Every expected number is computed in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashinfer_triton import reference as ref
from helpers import page_table

LN2 = math.log(2.0)
FP8_DTYPES = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


# ----------------------------------------------------------------------------- helpers (independent of ref)
def check(actual, expected, name="output", atol=2e-5, rtol=2e-5):
    """float64 comparison: NaN never passes, infinities must match exactly, the worst element is reported."""
    a = torch.as_tensor(np.asarray(actual) if not torch.is_tensor(actual) else actual).detach().double().cpu()
    e = torch.as_tensor(np.asarray(expected) if not torch.is_tensor(expected) else expected).detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{name}: NaN at {torch.isnan(a).nonzero()[0].tolist()}"
    inf_mismatch = (torch.isinf(a) | torch.isinf(e)) & (a != e)
    if inf_mismatch.any():
        idx = tuple(inf_mismatch.nonzero()[0].tolist())
        raise AssertionError(f"{name}: infinity mismatch at {list(idx)}: got {a[idx].item()}, expected {e[idx].item()}")
    finite = torch.isfinite(e)
    a, e = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)
    err = (a - e).abs() - rtol * e.abs()
    if err.numel() and err.max().item() > atol:
        flat = int(err.reshape(-1).argmax())
        idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
        got, want = a.reshape(-1)[flat].item(), e.reshape(-1)[flat].item()
        raise AssertionError(
            f"{name}: worst at {idx}: got {got:.8g}, expected {want:.8g} (|diff| {abs(got - want):.3g})"
        )


def bottom_right_visible(qo_len, kv_len, causal=False, window_left=-1):
    """Bool [qo_len, kv_len] from SPEC's rules, written as explicit loops."""
    vis = np.ones((qo_len, kv_len), dtype=bool)
    for i in range(qo_len):
        diag = i + kv_len - qo_len
        for j in range(kv_len):
            if causal and j > diag:
                vis[i, j] = False
            if window_left >= 0 and j < diag - window_left:
                vis[i, j] = False
    return vis


def np_attention(q, k, v, scale, visible=None, cap=None, bias=None):
    """Float64 attention by explicit loops. q [qo, Hq, D], k/v [kv, Hkv, D]; bias(h, i, j) added after the cap.

    Returns o [qo, Hq, D] and base-2 lse [qo, Hq] (o = 0, lse = -inf for a row without keys).
    """
    q, k, v = (np.asarray(x.double() if torch.is_tensor(x) else x, dtype=np.float64) for x in (q, k, v))
    qo, hq, d = q.shape
    kv, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    o = np.zeros((qo, hq, v.shape[2]))
    lse = np.full((qo, hq), -np.inf)
    for h in range(hq):
        kh = h // group
        for i in range(qo):
            logits = []
            for j in range(kv):
                if visible is not None and not visible[i][j]:
                    continue
                s = float(np.dot(q[i, h], k[j, kh])) * scale
                if cap is not None:
                    s = cap * math.tanh(s / cap)
                if bias is not None:
                    s += bias(h, i, j)
                logits.append((j, s))
            if not logits:
                continue
            m = max(s for _, s in logits)
            weights = [(j, math.exp(s - m)) for j, s in logits]
            total = sum(w for _, w in weights)
            o[i, h] = sum(w * v[j, kh] for j, w in weights) / total
            lse[i, h] = (m + math.log(total)) / LN2
    return o, lse


def sdpa_attention(q, k, v, visible, scale):
    """torch SDPA in float64 with our own bool mask (True = attend), GQA via enable_gqa; LSE from scores
    computed here (grouped matmul) and torch.logsumexp, times log2(e)."""
    qd, kd, vd = q.double(), k.double(), v.double()
    qo, hq, d = qd.shape
    hkv = kd.shape[1]
    mask = torch.as_tensor(visible)
    o = F.scaled_dot_product_attention(
        qd.transpose(0, 1)[None],
        kd.transpose(0, 1)[None],
        vd.transpose(0, 1)[None],
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=hq != hkv,
    )[0].transpose(0, 1)
    # scores [Hkv, group, qo, kv]: query head h = kh * group + g reads KV head kh
    qg = qd.reshape(qo, hkv, hq // hkv, d).permute(1, 2, 0, 3)
    scores = torch.matmul(qg, kd.permute(1, 2, 0)[:, None]) * scale
    scores = scores.masked_fill(~mask, float("-inf")).reshape(hq, qo, -1)
    lse = (torch.logsumexp(scores, dim=-1) / LN2).transpose(0, 1)
    return o, lse


def rope_np(x, positions, scale=1.0, theta=1e4):
    """Rotate-half RoPE in float64 via complex numbers: pair (x[t], x[t + D/2]) is z = x[t] + i x[t + D/2],
    multiplied by exp(i * pos * theta**(-2t/D) / scale)."""
    x = np.asarray(x.double() if torch.is_tensor(x) else x, dtype=np.float64)
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for row, pos in enumerate(positions):
        for t in range(half):
            freq = theta ** (-2.0 * t / x.shape[-1]) / scale
            z = (x[row, :, t] + 1j * x[row, :, t + half]) * np.exp(1j * pos * freq)
            out[row, :, t], out[row, :, t + half] = z.real, z.imag
    return out


def build_paged(kv_lens, page_size, hkv, d, layout, form, dtype=torch.float32, spare=3):
    """A paged cache holding random data everywhere (spare pages and page tails too), pages shuffled.

    Returns (cache, indptr, indices, last_page_len, dense_k, dense_v, pages_of) where dense_k[b] is request b's
    [kv_len, Hkv, D] keys gathered token by token, and pages_of[b] its page ids.
    """
    indptr, indices, last, total = page_table(kv_lens, page_size, spare_pages=spare, seed=None)
    store_k = torch.randn(total, page_size, hkv, d).to(dtype)  # NHD pages
    store_v = torch.randn(total, page_size, hkv, d).to(dtype)
    dense_k, dense_v, pages_of = [], [], []
    for b, n in enumerate(kv_lens):
        pages = indices[indptr[b] : indptr[b + 1]].tolist()
        pages_of.append(pages)
        dk = torch.empty(n, hkv, d, dtype=dtype)
        dv = torch.empty(n, hkv, d, dtype=dtype)
        for t in range(n):
            dk[t] = store_k[pages[t // page_size], t % page_size]
            dv[t] = store_v[pages[t // page_size], t % page_size]
        dense_k.append(dk)
        dense_v.append(dv)
    if form == "3d":
        assert page_size == 1
        cache = (store_k[:, 0].clone(), store_v[:, 0].clone())  # [slots, Hkv, D] whatever the layout
    else:
        kc, vc = store_k, store_v
        if layout == "HND":
            kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        cache = torch.stack([kc, vc], dim=1) if form == "5d" else (kc, vc)
    return cache, indptr, indices, last, dense_k, dense_v, pages_of


# ----------------------------------------------------------------------------- against SDPA
SDPA_CASES = [
    # (qo_len, kv_len, Hq, Hkv, D, causal)
    (1, 37, 8, 8, 64, False),
    (7, 7, 3, 1, 80, True),
    (5, 23, 16, 4, 128, True),
    (9, 33, 8, 1, 256, True),
    (13, 13, 12, 4, 64, False),
    (4, 19, 4, 4, 256, False),
    (6, 6, 8, 8, 128, True),
    (3, 17, 24, 8, 80, True),
    (11, 29, 6, 2, 64, True),
]


@pytest.mark.parametrize(
    "qo_len,kv_len,hq,hkv,d,causal",
    SDPA_CASES,
    ids=[f"qo{a}-kv{b}-hq{c}-hkv{e}-d{f}-{'causal' if g else 'full'}" for a, b, c, e, f, g in SDPA_CASES],
)
def test_attention_matches_sdpa(qo_len, kv_len, hq, hkv, d, causal):
    q = torch.randn(qo_len, hq, d)
    k = torch.randn(kv_len, hkv, d)
    v = torch.randn(kv_len, hkv, d)
    o, lse = ref.attention(q, k, v, causal=causal)
    vis = bottom_right_visible(qo_len, kv_len, causal)
    o_exp, lse_exp = sdpa_attention(q, k, v, vis, 1.0 / math.sqrt(d))
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    check(o, o_exp, "o")
    check(lse, lse_exp, "lse")
    # the same through the public single-request entry point
    o2, lse2 = ref.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True)
    check(o2, o_exp, "single_prefill o")
    check(lse2, lse_exp, "single_prefill lse")


def test_causal_bottom_right_differs_from_top_left():
    """qo_len < kv_len: bottom-right alignment lets query 0 see kv_len - qo_len + 1 keys, not 1."""
    q, k, v = torch.randn(3, 2, 64), torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    o, lse = ref.attention(q, k, v, causal=True)
    o_br, lse_br = sdpa_attention(q, k, v, bottom_right_visible(3, 10, causal=True), 1 / 8)
    check(o, o_br, "o")
    check(lse, lse_br, "lse")
    top_left = np.tril(np.ones((3, 10), dtype=bool))
    o_tl, _ = sdpa_attention(q, k, v, top_left, 1 / 8)
    assert (o.double() - o_tl).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_entry_points_half_inputs_and_layouts(dtype, layout):
    q = torch.randn(5, 6, 128).to(dtype)
    k = torch.randn(21, 2, 128).to(dtype)
    v = torch.randn(21, 2, 128).to(dtype)
    kl = k if layout == "NHD" else k.transpose(0, 1).contiguous()
    vl = v if layout == "NHD" else v.transpose(0, 1).contiguous()
    o, lse = ref.single_prefill_with_kv_cache(q, kl, vl, causal=True, kv_layout=layout, return_lse=True)
    o_exp, lse_exp = sdpa_attention(q, k, v, bottom_right_visible(5, 21, True), 1 / math.sqrt(128))
    check(o, o_exp, "prefill o")
    check(lse, lse_exp, "prefill lse")
    od, lsed = ref.single_decode_with_kv_cache(q[0], kl, vl, kv_layout=layout, return_lse=True)
    o_exp, lse_exp = sdpa_attention(q[:1], k, v, np.ones((1, 21), dtype=bool), 1 / math.sqrt(128))
    assert od.shape == (6, 128) and lsed.shape == (6,)
    check(od, o_exp[0], "decode o")
    check(lsed, lse_exp[0], "decode lse")


# ----------------------------------------------------------------------------- hand-computed cases
def test_sm_scale_hand():
    """One query, two keys, D = 2, explicit numbers."""
    q = torch.tensor([[[1.0, 2.0]]])
    k = torch.tensor([[[3.0, -1.0]], [[0.5, 0.5]]])
    v = torch.tensor([[[1.0, 10.0]], [[-2.0, 4.0]]])
    # q.k0 = 1, q.k1 = 1.5; with sm_scale 0.3: s = 0.3, 0.45
    s0, s1 = 0.3, 0.45
    p0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    o_exp = [p0 * 1.0 + (1 - p0) * -2.0, p0 * 10.0 + (1 - p0) * 4.0]
    lse_exp = math.log2(math.exp(s0) + math.exp(s1))
    o, lse = ref.attention(q, k, v, sm_scale=0.3)
    check(o[0, 0], o_exp, "o")
    check(lse[0, 0], lse_exp, "lse")
    # default sm_scale = 1/sqrt(2)
    o, lse = ref.attention(q, k, v)
    s0, s1 = 1 / math.sqrt(2), 1.5 / math.sqrt(2)
    check(lse[0, 0], math.log2(math.exp(s0) + math.exp(s1)), "lse default scale")


def test_lse_is_base_2_hand():
    """q = 0: all scores 0, so lse = log2(kv_len) and o = mean of V."""
    v = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 9.0]], [[7.0, 1.0]]])
    o, lse = ref.attention(torch.zeros(1, 1, 2), torch.randn(4, 1, 2), v)
    check(lse[0, 0], 2.0, "lse")
    check(o[0, 0], [4.0, 4.0], "o")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_left_hand(causal):
    """qo_len 3, kv_len 5, w = 1: the diagonal of query i is key i + 2; keys >= i + 1 stay."""
    visible_sets = [{1, 2}, {2, 3}, {3, 4}] if causal else [{1, 2, 3, 4}, {2, 3, 4}, {3, 4}]
    q, k = torch.randn(3, 1, 4), torch.randn(5, 1, 4)
    v = torch.tensor([[[float(10**j)] * 4] for j in range(5)])  # key j contributes 10**j: shows the key set
    vis = [[j in visible_sets[i] for j in range(5)] for i in range(3)]
    o_exp, lse_exp = np_attention(q, k, v, 0.5, visible=vis)
    o, lse = ref.attention(q, k, v, causal=causal, window_left=1)
    check(o, o_exp, "o", atol=1e-3, rtol=1e-5)
    check(lse, lse_exp, "lse")
    # with q = 0 the weights are uniform: o is the mean of exactly the visible keys' values
    o, lse = ref.attention(torch.zeros(3, 1, 4), k, v, causal=causal, window_left=1)
    for i, keys in enumerate(visible_sets):
        check(o[i, 0, 0], sum(10.0**j for j in keys) / len(keys), f"row {i} mean", rtol=1e-6)
        check(lse[i, 0], math.log2(len(keys)), f"row {i} lse")


def test_window_left_zero_and_decode():
    """Causal with w = 0 keeps only the diagonal key; decode with w keeps the last w + 1 keys."""
    q, k, v = torch.randn(2, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    o, lse = ref.attention(q, k, v, causal=True, window_left=0)
    check(o[0], v[4], "row 0 = v[4]", atol=1e-6)
    check(o[1], v[5], "row 1 = v[5]", atol=1e-6)
    s = (q[0] * k[4]).sum(-1).double() / math.sqrt(8)
    check(lse[0], s / LN2, "lse single key")
    # without causal, w = 0 drops only the keys left of the diagonal: row 0 sees keys 4 and 5
    o, lse = ref.attention(q, k, v, window_left=0)
    o_exp, lse_exp = np_attention(
        q, k, v, 1 / math.sqrt(8), visible=[[j >= 4 for j in range(6)], [j >= 5 for j in range(6)]]
    )
    check(o, o_exp, "non-causal o")
    check(lse, lse_exp, "non-causal lse")
    od, lsed = ref.single_decode_with_kv_cache(q[1], k, v, window_left=2, return_lse=True)
    o_exp, lse_exp = np_attention(q[1:], k[3:], v[3:], 1 / math.sqrt(8))
    check(od, o_exp[0], "decode o")
    check(lsed, lse_exp[0], "decode lse")


def test_logits_soft_cap_hand():
    q = torch.tensor([[[2.0, 1.0]]])
    k = torch.tensor([[[4.0, 0.0]], [[-1.0, 3.0]], [[1.0, 1.0]]])
    v = torch.tensor([[[1.0]], [[2.0]], [[4.0]]])
    c = 1.5
    raw = [8.0 * 0.5, 1.0 * 0.5, 3.0 * 0.5]  # q.k * sm_scale(0.5)
    s = [c * math.tanh(x / c) for x in raw]
    z = sum(math.exp(x) for x in s)
    o_exp = sum(math.exp(x) * val for x, val in zip(s, [1.0, 2.0, 4.0])) / z
    o, lse = ref.attention(q, k, v, sm_scale=0.5, logits_soft_cap=c)
    check(o[0, 0, 0], o_exp, "o")
    check(lse[0, 0], math.log2(z), "lse")
    # the cap bounds every score: lse <= log2(kv_len * e**c)
    assert lse[0, 0].item() <= math.log2(3 * math.exp(c)) + 1e-6


def test_alibi_slopes_formula():
    expected_8 = [2.0**-k for k in range(1, 9)]
    expected_12 = expected_8 + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    check(ref.alibi_slopes(8), expected_8, "H=8", atol=0, rtol=1e-7)
    check(ref.alibi_slopes(12), expected_12, "H=12", atol=0, rtol=1e-7)
    check(ref.alibi_slopes(1), [2.0**-8], "H=1", atol=0, rtol=1e-7)
    check(ref.alibi_slopes(4), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8], "H=4", atol=0, rtol=1e-7)


@pytest.mark.parametrize("hq,hkv", [(8, 4), (12, 4)], ids=["hq8", "hq12"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_hand(hq, hkv, causal):
    n = 8  # 2**floor(log2(H)) for both 8 and 12
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * (2 * k - 1) / n) for k in range(1, hq - n + 1)]
    qo, kv = 3, 7
    q, k, v = torch.randn(qo, hq, 16), torch.randn(kv, hkv, 16), torch.randn(kv, hkv, 16)
    vis = bottom_right_visible(qo, kv, causal)
    o_exp, lse_exp = np_attention(q, k, v, 0.25, visible=vis, bias=lambda h, i, j: slopes[h] * (j - i))
    o, lse = ref.attention(q, k, v, causal=causal, sm_scale=0.25, pos_encoding_mode="ALIBI")
    check(o, o_exp, "o")
    check(lse, lse_exp, "lse")
    # decode: qo_idx = 0, so the bias is slope_h * j (this moves the LSE, not only o)
    od, lsed = ref.single_decode_with_kv_cache(q[0], k, v, pos_encoding_mode="ALIBI", sm_scale=0.25, return_lse=True)
    o_exp, lse_exp = np_attention(q[:1], k, v, 0.25, bias=lambda h, i, j: slopes[h] * j)
    check(od, o_exp[0], "decode o")
    check(lsed, lse_exp[0], "decode lse")


def test_alibi_with_soft_cap_order():
    """FlashInfer 0.7's order (SPEC): s = c * tanh(sm_scale * (q.k * sm_scale + slope_h * (j - i)) / c)."""
    q, k, v = torch.randn(2, 8, 16), torch.randn(5, 8, 16), torch.randn(5, 8, 16)
    slopes = ref.alibi_slopes(8).double().numpy()
    qd, kd, vd = (x.double().numpy() for x in (q, k, v))
    o_exp, lse_exp = np.zeros((2, 8, 16)), np.zeros((2, 8))
    for h in range(8):
        for i in range(2):
            s = np.array(
                [
                    2.0 * math.tanh(0.5 * (float(qd[i, h] @ kd[j, h]) * 0.5 + slopes[h] * (j - i)) / 2.0)
                    for j in range(5)
                ]
            )
            w = np.exp(s - s.max())
            o_exp[i, h] = (w[:, None] * vd[:, h]).sum(0) / w.sum()
            lse_exp[i, h] = (s.max() + math.log(w.sum())) / LN2
    o, lse = ref.attention(q, k, v, sm_scale=0.5, logits_soft_cap=2.0, pos_encoding_mode="ALIBI")
    check(o, o_exp, "o")
    check(lse, lse_exp, "lse")


def test_apply_rope_llama_hand():
    """D = 4 at position 1: pair (x0, x2) turns by 1 rad (freq 1), pair (x1, x3) by 0.01 rad (1e4**-0.5)."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    expected = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2]
    check(ref.apply_rope_llama(x, torch.tensor([1]))[0, 0], expected, "theta 1e4")
    # rope_scale 2 halves every angle; rope_theta 100 makes freq_1 = 0.1
    c1, s1, c2, s2 = math.cos(0.5), math.sin(0.5), math.cos(0.005), math.sin(0.005)
    expected = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2]
    check(ref.apply_rope_llama(x, torch.tensor([1]), rope_scale=2.0)[0, 0], expected, "scale 2")
    c2, s2 = math.cos(0.1), math.sin(0.1)
    expected = [1 * math.cos(1) - 3 * math.sin(1), 2 * c2 - 4 * s2, 3 * math.cos(1) + math.sin(1), 4 * c2 + 2 * s2]
    check(ref.apply_rope_llama(x, torch.tensor([1]), rope_theta=100.0)[0, 0], expected, "theta 100")


@pytest.mark.parametrize("rope_scale,rope_theta", [(None, None), (2.0, None), (None, 500.0), (4.0, 1e6)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rope_llama_attention(rope_scale, rope_theta, causal):
    qo, kv, d = 3, 8, 16
    q, k, v = torch.randn(qo, 4, d), torch.randn(kv, 2, d), torch.randn(kv, 2, d)
    scale, theta = rope_scale or 1.0, rope_theta or 1e4
    qr = rope_np(q, [kv - qo + i for i in range(qo)], scale, theta)
    kr = rope_np(k, list(range(kv)), scale, theta)
    vis = bottom_right_visible(qo, kv, causal)
    o_exp, lse_exp = np_attention(qr, kr, v, 1 / 4, visible=vis)
    opts = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=rope_scale, rope_theta=rope_theta)
    o, lse = ref.attention(q, k, v, causal=causal, **opts)
    check(o, o_exp, "o")
    check(lse, lse_exp, "lse")
    # rope really changes the result, and so do non-default scale/theta
    o_plain, _ = ref.attention(q, k, v, causal=causal)
    assert (o - o_plain).abs().max() > 1e-3
    if rope_scale or rope_theta:
        o_default, _ = ref.attention(q, k, v, causal=causal, pos_encoding_mode="ROPE_LLAMA")
        assert (o - o_default).abs().max() > 1e-3
    # decode: the query sits at kv_len - 1
    od, lsed = ref.single_decode_with_kv_cache(q[0], k, v, return_lse=True, **opts)
    o_exp, lse_exp = np_attention(rope_np(q[:1], [kv - 1], scale, theta), kr, v, 1 / 4)
    check(od, o_exp[0], "decode o")
    check(lsed, lse_exp[0], "decode lse")


def test_rope_scores_depend_on_relative_position():
    """One key vector at every position: RoPE makes the decode score of key j a function of kv_len - 1 - j,
    so the last five of nine identical keys (window_left=4) score exactly as a cache of five."""
    d = 16
    qv, kvec, vals = torch.randn(2, d), torch.randn(1, 1, d), torch.randn(5, 1, d)
    opts = dict(pos_encoding_mode="ROPE_LLAMA", return_lse=True, rope_theta=50.0)
    o5, lse5 = ref.single_decode_with_kv_cache(qv, kvec.expand(5, 1, d), vals, **opts)
    v9 = torch.cat([torch.randn(4, 1, d), vals])
    o9, lse9 = ref.single_decode_with_kv_cache(qv, kvec.expand(9, 1, d), v9, window_left=4, **opts)
    check(o9, o5, "o", atol=1e-5)
    check(lse9, lse5, "lse", atol=1e-5)
    # without the window the extra keys do count
    o9_all, _ = ref.single_decode_with_kv_cache(qv, kvec.expand(9, 1, d), v9, **opts)
    assert (o9_all - o5).abs().max() > 1e-3


@pytest.mark.skipif(not FP8_DTYPES, reason="no float8 dtypes in this torch")
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_fp8_kv_scales(fp8):
    qo, kv, hq, hkv, d = 4, 19, 8, 2, 64
    q = torch.randn(qo, hq, d).half()
    k = torch.randn(kv, hkv, d).to(fp8)
    v = torch.randn(kv, hkv, d).to(fp8)
    k_scale, v_scale, q_scale = 0.7, 1.9, 1.3
    vis = bottom_right_visible(qo, kv, True)
    o_exp, lse_exp = sdpa_attention(q, k.double(), v.double(), vis, k_scale / 8)
    o, lse = ref.single_prefill_with_kv_cache(q, k, v, causal=True, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    check(o, o_exp * v_scale, "prefill o")
    check(lse, lse_exp, "prefill lse")
    od, lsed = ref.single_decode_with_kv_cache(
        q[0], k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True
    )
    o_exp, lse_exp = sdpa_attention(q[:1], k.double(), v.double(), np.ones((1, kv), bool), q_scale * k_scale / 8)
    check(od, o_exp[0] * v_scale, "decode o")
    check(lsed, lse_exp[0], "decode lse")


@pytest.mark.skipif(not FP8_DTYPES, reason="no float8 dtypes in this torch")
def test_fp8_hand():
    """Values exact in e4m3: q = [1, 1], k = [[0.5, 0.25], [-1, 2]], v = [[2], [-0.5]], D = 2."""
    fp8 = FP8_DTYPES[0]
    q = torch.tensor([[1.0, 1.0]])
    k = torch.tensor([[[0.5, 0.25]], [[-1.0, 2.0]]]).to(fp8)
    v = torch.tensor([[[2.0]], [[-0.5]]]).to(fp8)
    base = 1 / math.sqrt(2)
    s = [0.75 * base * 2.0 * 0.5, 1.0 * base * 2.0 * 0.5]  # q.k * sm_scale * k_scale(2) * q_scale(0.5)
    z = math.exp(s[0]) + math.exp(s[1])
    o_exp = 3.0 * (math.exp(s[0]) * 2.0 + math.exp(s[1]) * -0.5) / z  # times v_scale 3
    o, lse = ref.single_decode_with_kv_cache(q, k, v, q_scale=0.5, k_scale=2.0, v_scale=3.0, return_lse=True)
    check(o[0, 0], o_exp, "o")
    check(lse[0], math.log2(z), "lse")


# ----------------------------------------------------------------------------- empty rows and masks
def test_empty_request_and_fully_masked_rows():
    q = torch.randn(3, 4, 16)
    o, lse = ref.attention(q, torch.randn(0, 2, 16), torch.randn(0, 2, 16), causal=True)
    check(o, torch.zeros(3, 4, 16), "o empty kv")
    check(lse, torch.full((3, 4), float("-inf")), "lse empty kv")
    od, lsed = ref.single_decode_with_kv_cache(q[0], torch.randn(0, 2, 16), torch.randn(0, 2, 16), return_lse=True)
    check(od, torch.zeros(4, 16), "decode o")
    check(lsed, torch.full((4,), float("-inf")), "decode lse")
    # a custom mask with an all-False row
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    mask = torch.tensor([[True, False, True, False, False], [False] * 5, [True] * 5])
    o, lse = ref.attention(q, k, v, custom_mask=mask)
    check(o[1], torch.zeros(4, 16), "masked row o")
    check(lse[1], torch.full((4,), float("-inf")), "masked row lse")
    o_exp, lse_exp = np_attention(q, k, v, 0.25, visible=mask.numpy())
    check(o, o_exp, "o")
    check(lse, lse_exp, "lse")
    # causal with qo_len > kv_len: the first qo_len - kv_len rows see nothing
    q = torch.randn(6, 2, 16)
    o, lse = ref.attention(q, k[:4], v[:4], causal=True)
    o_exp, lse_exp = np_attention(q, k[:4], v[:4], 0.25, visible=bottom_right_visible(6, 4, True))
    assert np.isinf(lse_exp[:2]).all() and np.isfinite(lse_exp[2:]).all()
    check(o, o_exp, "o qo>kv")
    check(lse, lse_exp, "lse qo>kv")


def test_custom_mask_overrides_causal():
    q, k, v = torch.randn(4, 3, 32), torch.randn(6, 3, 32), torch.randn(6, 3, 32)
    mask = torch.rand(4, 6) < 0.6
    mask[:, 5] = True  # every row sees a key that causal would hide for row 0
    o_c, lse_c = ref.attention(q, k, v, custom_mask=mask, causal=True)
    o_exp, lse_exp = sdpa_attention(q, k, v, mask.numpy(), 1 / math.sqrt(32))
    check(o_c, o_exp, "o")
    check(lse_c, lse_exp, "lse")
    o_plain, _ = ref.attention(q, k, v, causal=True)
    assert (o_c - o_plain).abs().max() > 1e-3


def test_custom_mask_with_window():
    """The window still applies on top of a custom mask (SPEC: the mask overrides causal only)."""
    q, k, v = torch.randn(3, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    mask = torch.ones(3, 5, dtype=torch.bool)
    o, lse = ref.attention(q, k, v, custom_mask=mask, window_left=1)
    o_exp, lse_exp = np_attention(q, k, v, 1 / math.sqrt(8), visible=bottom_right_visible(3, 5, False, 1))
    check(o, o_exp, "o")
    check(lse, lse_exp, "lse")


def test_packed_custom_mask_equals_bool_mask():
    q, k, v = torch.randn(5, 2, 16), torch.randn(7, 1, 16), torch.randn(7, 1, 16)
    mask = torch.rand(5, 7) < 0.5
    mask[:, 0] = True
    packed = torch.from_numpy(np.packbits(mask.numpy().reshape(-1), bitorder="little"))
    o_b, lse_b = ref.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True)
    o_p, lse_p = ref.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed, return_lse=True)
    check(o_p, o_b, "o", atol=0, rtol=0)
    check(lse_p, lse_b, "lse", atol=0, rtol=0)
    o_exp, _ = sdpa_attention(q, k, v, mask.numpy(), 0.25)
    check(o_b, o_exp, "o vs sdpa")


def test_unpack_segment_mask_roundtrip():
    qo_lens, kv_lens = [2, 0, 3, 1], [5, 4, 3, 0]
    masks = [np.random.default_rng(b).random((a, c)) < 0.5 for b, (a, c) in enumerate(zip(qo_lens, kv_lens))]
    flat = np.concatenate([m.reshape(-1) for m in masks])
    mask_indptr = np.cumsum([0] + [a * c for a, c in zip(qo_lens, kv_lens)])
    packed, new_indptr = ref.segment_packbits(torch.from_numpy(flat), torch.from_numpy(mask_indptr), "little")
    expected = np.concatenate([np.packbits(m.reshape(-1), bitorder="little") for m in masks])
    check(packed, expected, "packed", atol=0, rtol=0)
    back = ref.unpack_segment_mask(packed, new_indptr, qo_lens, kv_lens)
    assert back.dtype == torch.bool and back.tolist() == flat.tolist()


# ----------------------------------------------------------------------------- paged and batch
PAGED_CASES = [
    # (page_size, layout, form)
    (1, "NHD", "5d"),
    (1, "HND", "tuple"),
    (1, "NHD", "3d"),
    (1, "HND", "3d"),
    (5, "NHD", "5d"),
    (5, "HND", "5d"),
    (5, "NHD", "tuple"),
    (16, "HND", "tuple"),
    (16, "NHD", "5d"),
]
KV_LENS = [7, 0, 16, 1, 23]  # an empty request, a single token, an exact multiple of 16, partly filled pages


@pytest.mark.parametrize("page_size,layout,form", PAGED_CASES, ids=[f"ps{a}-{b}-{c}" for a, b, c in PAGED_CASES])
def test_paged_kv_to_dense(page_size, layout, form):
    cache, indptr, indices, last, dk, dv, _ = build_paged(KV_LENS, page_size, 3, 8, layout, form)
    for b, n in enumerate(KV_LENS):
        k, v = ref.paged_kv_to_dense(cache, layout, indptr, indices, last, b)
        assert k.shape == (n, 3, 8) and v.shape == (n, 3, 8)
        assert torch.equal(k, dk[b]) and torch.equal(v, dv[b]), f"request {b}"


@pytest.mark.parametrize("page_size,layout,form", PAGED_CASES, ids=[f"ps{a}-{b}-{c}" for a, b, c in PAGED_CASES])
def test_batch_decode_equals_single_calls(page_size, layout, form):
    hq, hkv, d = 6, 3, 16
    cache, indptr, indices, last, dk, dv, _ = build_paged(KV_LENS, page_size, hkv, d, layout, form)
    q = torch.randn(len(KV_LENS), hq, d)
    for opts in ({}, {"window_left": 4, "logits_soft_cap": 5.0}, {"pos_encoding_mode": "ROPE_LLAMA"}):
        o, lse = ref.batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last, layout, **opts)
        assert o.shape == (len(KV_LENS), hq, d) and lse.shape == (len(KV_LENS), hq)
        for b in range(len(KV_LENS)):
            ob, lseb = ref.single_decode_with_kv_cache(q[b], dk[b], dv[b], return_lse=True, **opts)
            check(o[b], ob, f"o[{b}] {opts}", atol=0, rtol=0)
            check(lse[b], lseb, f"lse[{b}] {opts}", atol=0, rtol=0)
    # and against independent code for the plain case
    o, lse = ref.batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last, layout)
    for b in range(len(KV_LENS)):
        o_exp, lse_exp = np_attention(q[b : b + 1], dk[b], dv[b], 0.25)
        check(o[b], o_exp[0], f"o[{b}] vs float64")
        check(lse[b], lse_exp[0], f"lse[{b}] vs float64")


@pytest.mark.parametrize("page_size,layout,form", [(5, "HND", "5d"), (1, "NHD", "3d"), (16, "NHD", "tuple")], ids=str)
@pytest.mark.parametrize("masking", ["causal", "custom", "none"])
def test_batch_prefill_paged_equals_single_calls(page_size, layout, form, masking):
    hq, hkv, d = 4, 2, 16
    qo_lens = [3, 2, 5, 1, 0]
    cache, indptr, indices, last, dk, dv, _ = build_paged(KV_LENS, page_size, hkv, d, layout, form)
    qo_indptr = torch.tensor(np.cumsum([0] + qo_lens), dtype=torch.int32)
    q = torch.randn(sum(qo_lens), hq, d)
    masks = [torch.rand(a, n) < 0.6 for a, n in zip(qo_lens, KV_LENS)]
    flat = torch.cat([m.reshape(-1) for m in masks]) if masking == "custom" else None
    o, lse = ref.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, indptr, indices, last, layout, custom_mask=flat, causal=masking == "causal"
    )
    assert o.shape == (sum(qo_lens), hq, d) and lse.shape == (sum(qo_lens), hq)
    for b in range(len(qo_lens)):
        s, e = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ob, lseb = ref.single_prefill_with_kv_cache(
            q[s:e],
            dk[b],
            dv[b],
            custom_mask=masks[b] if masking == "custom" else None,
            causal=masking == "causal",
            return_lse=True,
        )
        check(o[s:e], ob, f"o req {b}", atol=0, rtol=0)
        check(lse[s:e], lseb, f"lse req {b}", atol=0, rtol=0)
        vis = masks[b].numpy() if masking == "custom" else bottom_right_visible(e - s, KV_LENS[b], masking == "causal")
        o_exp, lse_exp = np_attention(q[s:e], dk[b], dv[b], 0.25, visible=vis)
        check(o[s:e], o_exp, f"o req {b} vs float64")
        check(lse[s:e], lse_exp, f"lse req {b} vs float64")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("masking", ["causal", "custom", "none"])
def test_batch_prefill_ragged_equals_single_calls(layout, masking):
    hq, hkv, d = 6, 2, 16
    qo_lens, kv_lens = [3, 0, 4, 2], [5, 3, 4, 0]
    qo_indptr = torch.tensor(np.cumsum([0] + qo_lens), dtype=torch.int32)
    kv_indptr = torch.tensor(np.cumsum([0] + kv_lens), dtype=torch.int32)
    q = torch.randn(sum(qo_lens), hq, d)
    k, v = torch.randn(sum(kv_lens), hkv, d), torch.randn(sum(kv_lens), hkv, d)
    masks = [torch.rand(a, n) < 0.6 for a, n in zip(qo_lens, kv_lens)]
    flat = torch.cat([m.reshape(-1) for m in masks]) if masking == "custom" else None
    kl = k if layout == "NHD" else k.transpose(0, 1).contiguous()
    vl = v if layout == "NHD" else v.transpose(0, 1).contiguous()
    o, lse = ref.batch_prefill_with_ragged_kv_cache(
        q, kl, vl, qo_indptr, kv_indptr, layout, custom_mask=flat, causal=masking == "causal"
    )
    for b in range(len(qo_lens)):
        qs, qe, ks, ke = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_indptr[b]), int(kv_indptr[b + 1])
        ob, lseb = ref.single_prefill_with_kv_cache(
            q[qs:qe],
            k[ks:ke],
            v[ks:ke],
            custom_mask=masks[b] if masking == "custom" else None,
            causal=masking == "causal",
            return_lse=True,
        )
        check(o[qs:qe], ob, f"o req {b}", atol=0, rtol=0)
        check(lse[qs:qe], lseb, f"lse req {b}", atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_levels", [2, 3])
def test_cascade_equals_full_attention(causal, num_levels):
    """Levels: a prefix shared by all requests, (3 levels) a middle part shared by requests {0, 1} and {2},
    then each request's own pages; equals attention over the concatenated KV (causal on the last level)."""
    page_size, hkv, hq, d = 4, 2, 6, 16
    qo_lens = [3, 2, 4]
    shared, mids, own = 9, [6, 5], [7, 3, 4]  # own lengths >= qo lengths, so causal needs only the last level
    parts = [shared] + (mids if num_levels == 3 else []) + own
    cache, _, _, _, dk, dv, pages_of = build_paged(parts, page_size, hkv, d, "NHD", "5d")
    q = torch.randn(sum(qo_lens), hq, d)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32)

    def table(part_ids):
        ptr, idx, last = [0], [], []
        for p in part_ids:
            idx += pages_of[p]
            ptr.append(len(idx))
            last.append(parts[p] - (len(pages_of[p]) - 1) * page_size)
        return i32(ptr), i32(idx), i32(last)

    qcum = list(np.cumsum([0] + qo_lens))
    levels = [([0, qcum[-1]], [0])]
    if num_levels == 3:
        levels.append(([0, qcum[2], qcum[3]], [1, 2]))
    first_own = len(parts) - 3
    levels.append((qcum, [first_own, first_own + 1, first_own + 2]))
    tables = [table(ids) for _, ids in levels]
    o, lse = ref.multi_level_cascade_attention(
        q,
        [i32(qi) for qi, _ in levels],
        cache,
        [t[0] for t in tables],
        [t[1] for t in tables],
        [t[2] for t in tables],
        "NHD",
        causal=causal,
    )
    for b in range(3):
        ids = [0] + ([1 if b < 2 else 2] if num_levels == 3 else []) + [first_own + b]
        kb, vb = torch.cat([dk[i] for i in ids]), torch.cat([dv[i] for i in ids])
        s, e = qcum[b], qcum[b + 1]
        o_exp, lse_exp = sdpa_attention(q[s:e], kb, vb, bottom_right_visible(e - s, kb.shape[0], causal), 0.25)
        check(o[s:e], o_exp, f"o req {b}")
        check(lse[s:e], lse_exp, f"lse req {b}")


# ----------------------------------------------------------------------------- attention states
def rand_state(n=5, h=3, d=8, empty_rows=()):
    v, s = torch.randn(n, h, d), torch.randn(n, h) * 3
    for r in empty_rows:
        s[r] = float("-inf")
    return v, s


def test_merge_state_hand():
    """s = log2(2**s_a + 2**s_b), v = (2**s_a v_a + 2**s_b v_b) / 2**s."""
    v, s = ref.merge_state(
        torch.tensor([[1.0, 0.0]]), torch.tensor([1.0]), torch.tensor([[0.0, 4.0]]), torch.tensor([3.0])
    )
    check(s, [math.log2(2 + 8)], "s")
    check(v, [[2 / 10, 4 * 8 / 10]], "v")


def test_merge_state_commutative_and_associative():
    a, b, c = rand_state(), rand_state(), rand_state()
    v_ab, s_ab = ref.merge_state(*a, *b)
    v_ba, s_ba = ref.merge_state(*b, *a)
    check(v_ab, v_ba, "v commutative", atol=1e-6)
    check(s_ab, s_ba, "s commutative", atol=1e-6)
    v_l, s_l = ref.merge_state(v_ab, s_ab, *c)
    v_r, s_r = ref.merge_state(*a, *ref.merge_state(*b, *c))
    check(v_l, v_r, "v associative", atol=1e-5)
    check(s_l, s_r, "s associative", atol=1e-5)
    # and the float64 formula
    va, sa = (x.double() for x in a)
    vb, sb = (x.double() for x in b)
    s_exp = torch.log2(torch.exp2(sa) + torch.exp2(sb))
    v_exp = (torch.exp2(sa)[..., None] * va + torch.exp2(sb)[..., None] * vb) / torch.exp2(s_exp)[..., None]
    check(s_ab, s_exp, "s formula")
    check(v_ab, v_exp, "v formula")


@pytest.mark.parametrize("split", ["halves", "interleaved", "causal-halves"])
def test_merge_state_equals_attention_over_union(split):
    qo, kv, hq, hkv, d = 4, 13, 6, 3, 32
    q, k, v = torch.randn(qo, hq, d), torch.randn(kv, hkv, d), torch.randn(kv, hkv, d)
    if split == "interleaved":
        sel_a = torch.arange(0, kv, 2)
        sel_b = torch.arange(1, kv, 2)
    else:
        sel_a, sel_b = torch.arange(0, 6), torch.arange(6, kv)
    full_vis = bottom_right_visible(qo, kv, split == "causal-halves")
    full_o, full_lse = sdpa_attention(q, k, v, full_vis, 1 / math.sqrt(d))
    vis_a = torch.from_numpy(full_vis[:, sel_a.numpy()])
    vis_b = torch.from_numpy(full_vis[:, sel_b.numpy()])
    o_a, lse_a = ref.attention(q, k[sel_a], v[sel_a], custom_mask=vis_a)
    o_b, lse_b = ref.attention(q, k[sel_b], v[sel_b], custom_mask=vis_b)
    o, lse = ref.merge_state(o_a, lse_a, o_b, lse_b)
    check(o, full_o, "o", atol=1e-5)
    check(lse, full_lse, "lse", atol=1e-5)


def test_merge_state_empty_sides():
    v_a, s_a = rand_state(empty_rows=(1, 3))
    v_b, s_b = rand_state(empty_rows=(3, 4))
    v, s = ref.merge_state(v_a, s_a, v_b, s_b)
    assert not torch.isnan(v).any() and not torch.isnan(s).any()
    check(v[1], v_b[1], "a empty: v = v_b", atol=0, rtol=0)
    check(s[1], s_b[1], "a empty: s = s_b", atol=0, rtol=0)
    check(v[4], v_a[4], "b empty: v = v_a", atol=0, rtol=0)
    check(s[4], s_a[4], "b empty: s = s_a", atol=0, rtol=0)
    check(v[3], torch.zeros(3, 8), "both empty: v = 0", atol=0, rtol=0)
    check(s[3], torch.full((3,), float("-inf")), "both empty: s = -inf")
    # an empty side's v may hold anything finite
    v2, s2 = ref.merge_state(torch.full_like(v_a, 1e4), torch.full_like(s_a, float("-inf")), v_b, s_b)
    check(v2[torch.isfinite(s_b)], v_b[torch.isfinite(s_b)], "v from b only", atol=0, rtol=0)


def test_merge_states_equals_sequential():
    n, k, h, d = 4, 5, 3, 8
    v, s = torch.randn(n, k, h, d), torch.randn(n, k, h) * 2
    s[0, :2] = float("-inf")
    s[1] = float("-inf")  # all states empty
    v_m, s_m = ref.merge_states(v, s)
    v_acc, s_acc = v[:, 0], s[:, 0]
    for i in range(1, k):
        v_acc, s_acc = ref.merge_state(v_acc, s_acc, v[:, i], s[:, i])
    check(v_m, v_acc, "v", atol=1e-6)
    check(s_m, s_acc, "s", atol=1e-6)
    check(v_m[1], torch.zeros(h, d), "all empty v")
    check(s_m[1], torch.full((h,), float("-inf")), "all empty s")
    # float64 formula: s = log2(sum 2**s_k), v = sum 2**(s_k - s) v_k
    sd, vd = s.double(), v.double()
    s_exp = torch.logsumexp(sd * LN2, dim=1) / LN2
    w = torch.exp2(sd - torch.where(torch.isfinite(s_exp), s_exp, 0)[:, None])
    v_exp = torch.where(torch.isfinite(s_exp)[..., None], (w[..., None] * vd).sum(1), 0.0)
    check(v_m, v_exp, "v formula")
    check(s_m, s_exp, "s formula")
    # one state merges to itself
    v1, s1 = ref.merge_states(v[:, :1], s[:, :1])
    check(v1, v[:, 0], "K=1 v", atol=0, rtol=0)
    check(s1, s[:, 0], "K=1 s", atol=0, rtol=0)


def test_merge_states_zero_states():
    v_m, s_m = ref.merge_states(torch.randn(2, 0, 3, 4), torch.randn(2, 0, 3))
    check(v_m, torch.zeros(2, 3, 4), "v")
    check(s_m, torch.full((2, 3), float("-inf")), "s")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_merge_state_in_place_respects_mask(dtype, with_mask):
    v, s = rand_state(n=6, empty_rows=(2,))
    v_o, s_o = rand_state(n=6, empty_rows=(2, 5))
    v = v.to(dtype)
    mask = torch.tensor([True, False, True, False, True, True]) if with_mask else None
    v_before, s_before = v.clone(), s.clone()
    v_exp, s_exp = ref.merge_state(v, s, v_o, s_o)
    ref.merge_state_in_place(v, s, v_o, s_o, mask=mask)
    assert v.dtype == dtype and s.dtype == torch.float32
    rows = range(6) if mask is None else [r for r in range(6) if mask[r]]
    for r in range(6):
        if r in rows:
            check(v[r], v_exp[r].to(dtype), f"merged v row {r}", atol=0, rtol=0)
            check(s[r], s_exp[r], f"merged s row {r}", atol=0, rtol=0)
        else:
            assert torch.equal(v[r].view(torch.uint8), v_before[r].view(torch.uint8)), f"row {r} of v touched"
            assert torch.equal(s[r].view(torch.uint8), s_before[r].view(torch.uint8)), f"row {r} of s touched"


# ----------------------------------------------------------------------------- bit packing and page helpers
@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 13, 64, 101])
def test_packbits_matches_numpy(bitorder, n):
    x = np.random.default_rng(n).random(n) < 0.5
    got = ref.packbits(torch.from_numpy(x), bitorder)
    assert got.dtype == torch.uint8
    assert got.tolist() == np.packbits(x, bitorder=bitorder).tolist()
    # non-bool input: nonzero counts as 1, as in numpy
    xi = (np.random.default_rng(n + 1).integers(0, 4, n)).astype(np.uint8)
    assert ref.packbits(torch.from_numpy(xi), bitorder).tolist() == np.packbits(xi != 0, bitorder=bitorder).tolist()


def test_packbits_hand():
    x = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert ref.packbits(x, "big").tolist() == [0b10110000, 0b10000000]
    assert ref.packbits(x, "little").tolist() == [0b00001101, 0b00000001]
    assert ref.packbits(x).tolist() == [0b10110000, 0b10000000], "default bitorder is big"
    packed, new_indptr = ref.segment_packbits(x, torch.tensor([0, 9]))
    assert packed.tolist() == [0b10110000, 0b10000000] and new_indptr.tolist() == [0, 2], "default bitorder is big"


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("lens", [[3, 0, 8, 17, 0, 1], [0], [], [9, 9]], ids=str)
def test_segment_packbits_matches_numpy(bitorder, lens):
    indptr = np.cumsum([0] + lens)
    x = np.random.default_rng(len(lens)).random(int(indptr[-1])) < 0.5
    packed, new_indptr = ref.segment_packbits(torch.from_numpy(x), torch.from_numpy(indptr), bitorder)
    expected = [np.packbits(x[indptr[i] : indptr[i + 1]], bitorder=bitorder) for i in range(len(lens))]
    flat = np.concatenate(expected) if expected else np.zeros(0, np.uint8)
    assert packed.dtype == torch.uint8 and packed.tolist() == flat.tolist()
    assert new_indptr.tolist() == list(np.cumsum([0] + [(n + 7) // 8 for n in lens]))


def test_get_seq_lens_hand():
    indptr = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    last = torch.tensor([3, 2, 1, 4], dtype=torch.int32)  # request 1 has no pages: length 0 whatever last says
    got = ref.get_seq_lens(indptr, last, 4)
    assert got.tolist() == [4 + 3, 0, 2 * 4 + 1, 4]
    got = ref.get_seq_lens(torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), 1)
    assert got.tolist() == [1, 3]


def test_get_batch_indices_positions_hand():
    # request 0 appends 2 tokens to reach 4, request 1 appends none, request 2 appends 3 to reach 3 (fresh)
    append_indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    seq_lens = torch.tensor([4, 1, 3], dtype=torch.int32)
    b, p = ref.get_batch_indices_positions(append_indptr, seq_lens, 5)
    assert b.dtype == torch.int32 and p.dtype == torch.int32
    assert b.tolist() == [0, 0, 2, 2, 2]
    assert p.tolist() == [2, 3, 0, 1, 2]


APPEND_CASES = [
    (1, "NHD", "5d"),
    (1, "NHD", "3d"),
    (1, "HND", "3d"),
    (5, "NHD", "5d"),
    (5, "HND", "5d"),
    (5, "HND", "tuple"),
    (16, "NHD", "tuple"),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
@pytest.mark.parametrize("page_size,layout,form", APPEND_CASES, ids=[f"ps{a}-{b}-{c}" for a, b, c in APPEND_CASES])
def test_append_paged_kv_cache_writes_exactly_the_addressed_slots(page_size, layout, form, fp8):
    if fp8 and not FP8_DTYPES:
        pytest.skip("no float8 dtypes in this torch")
    cache_dtype = FP8_DTYPES[0] if fp8 else torch.float16
    hkv, d = 2, 8
    old_lens, add = [3, 0, 10, 5], [2, 4, 7, 0]
    new_lens = [a + b for a, b in zip(old_lens, add)]
    cache, indptr, indices, last, _, _, pages_of = build_paged(new_lens, page_size, hkv, d, layout, form, cache_dtype)
    nnz = sum(add)
    key, value = torch.randn(nnz, hkv, d).half(), torch.randn(nnz, hkv, d).half()
    batch_indices, positions = [], []
    for r, (o, a) in enumerate(zip(old_lens, add)):
        batch_indices += [r] * a
        positions += list(range(o, o + a))
    tensors = list(cache) if isinstance(cache, tuple) else [cache]
    before = [t.clone() for t in tensors]
    # expected, slot by slot on the underlying tensors
    expected = [t.clone() for t in tensors]
    for t in range(nnz):
        r, pos = batch_indices[t], positions[t]
        page, slot = pages_of[r][pos // page_size], pos % page_size
        for kv, src in ((0, key), (1, value)):
            val = src[t].to(cache_dtype)
            if form == "3d":
                expected[kv][page] = val
            elif form == "tuple":
                if layout == "NHD":
                    expected[kv][page, slot] = val
                else:
                    expected[kv][page, :, slot] = val
            elif layout == "NHD":
                expected[0][page, kv, slot] = val
            else:
                expected[0][page, kv, :, slot] = val
    ref.append_paged_kv_cache(
        key,
        value,
        torch.tensor(batch_indices, dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int32),
        cache,
        indices,
        indptr,
        last,
        layout,
    )
    for after, exp, old in zip(tensors, expected, before):
        got_bytes, exp_bytes = after.view(torch.uint8), exp.view(torch.uint8)
        changed = (got_bytes != exp_bytes).nonzero()
        assert changed.numel() == 0, f"byte mismatch at {changed[0].tolist()} (of {changed.shape[0]})"
        assert not torch.equal(after.view(torch.uint8), old.view(torch.uint8)), "nothing was written"
