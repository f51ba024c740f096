"""``flashinfer_triton.rope`` against a float64 reference (paths as in ``test_norm``).

The reference rotates pair ``(x[j], x[j + rot/2])`` (NeoX) or ``(x[2j], x[2j+1])`` (interleaved) by
``pos * theta^(-2j/rot) / scale`` (Llama 3.1: blended by wavelength), written here from the formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import HAS_CUDA, INTERPRET, assert_close
from flashinfer_triton import rope

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (nnz, num_q_heads, num_k_heads, head_dim)
SMALL = [(5, 3, 1, 64), (7, 2, 2, 128)]
LARGE = [(1, 9, 3, 64), (32, 9, 3, 64), (256, 9, 3, 64), (1, 32, 8, 128), (32, 32, 8, 128), (512, 32, 8, 128)]
# A float32 angle pos * freq is accurate to ~5e-4 radians up to this position, so the tolerances hold.
MAX_POS = 4096


def _paths():
    return [
        pytest.param("torch", SMALL, id="torch"),
        pytest.param("kernel", SMALL[:1], id="kernel", marks=pytest.mark.interpret),
        pytest.param("gpu", LARGE, id="gpu", marks=pytest.mark.gpu),
    ]


def _device(path: str) -> str:
    if path == "torch":
        if INTERPRET:
            pytest.skip("CPU tensors run the interpreter kernel under TRITON_INTERPRET=1")
        return "cpu"
    return "cuda" if HAS_CUDA else "cpu"


def ref_freq(rot, scale, theta, llama31=None):
    j = torch.arange(rot // 2, dtype=torch.float64)
    f = theta ** (-2 * j / rot)
    if llama31 is None:
        return f / scale
    low, high, old = llama31
    wavelen = 2 * math.pi / f
    smooth = ((old / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * f / scale + smooth * f


def ref_rotate(x, pos, rot, interleave, cos, sin):
    """``cos``/``sin``: ``[nnz, rot/2]`` float64."""
    x = x.double().clone()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        a, b = x[..., 0:rot:2].clone(), x[..., 1:rot:2].clone()
        x[..., 0:rot:2], x[..., 1:rot:2] = a * c - b * s, b * c + a * s
    else:
        h = rot // 2
        a, b = x[..., :h].clone(), x[..., h:rot].clone()
        x[..., :h], x[..., h:rot] = a * c - b * s, b * c + a * s
    return x


def ref_rope(x, pos, rot, interleave, freq):
    ang = pos.double().cpu()[:, None] * freq[None, :]
    return ref_rotate(x.cpu(), pos, rot, interleave, torch.cos(ang), torch.sin(ang))


def _qk(nnz, hq, hk, d, dtype, dev):
    # q and k are views into one packed qkv row, as in engines.
    qkv = torch.randn(nnz, (hq + 2 * hk) * d, device=dev).to(dtype)
    q = qkv[:, : hq * d].view(nnz, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(nnz, hk, d)
    return q, k


def _tol(dtype):
    return {torch.float32: (1e-3, 1e-3), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2)}[dtype]


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("llama31", [False, True])
def test_rope_pos_ids(path, shapes, dtype, interleave, llama31):
    dev = _device(path)
    atol, rtol = _tol(dtype)
    for nnz, hq, hk, d in shapes:
        for rot in (d, d // 2):
            q, k = _qk(nnz, hq, hk, d, dtype, dev)
            pos = torch.randint(0, MAX_POS, (nnz,), device=dev, dtype=torch.int32)
            if llama31:
                kw = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0)
                freq = ref_freq(rot, 8.0, 5e5, (1.0, 4.0, 8192))
                fn, fn_inplace = rope.apply_llama31_rope_pos_ids, rope.apply_llama31_rope_pos_ids_inplace
            else:
                kw = dict(rope_scale=2.0, rope_theta=1e4)
                freq = ref_freq(rot, 2.0, 1e4)
                fn, fn_inplace = rope.apply_rope_pos_ids, rope.apply_rope_pos_ids_inplace
            eq, ek = ref_rope(q, pos, rot, interleave, freq), ref_rope(k, pos, rot, interleave, freq)
            q0, k0 = q.clone(), k.clone()
            qr, kr = fn(q, k, pos, rotary_dim=rot, interleave=interleave, **kw)
            assert torch.equal(q, q0) and torch.equal(k, k0), "out-of-place variant wrote its input"
            assert_close(qr, eq, atol, rtol, name=f"q_rope rot={rot}")
            assert_close(kr, ek, atol, rtol, name=f"k_rope rot={rot}")
            assert fn_inplace(q, k, pos.long(), rotary_dim=rot, interleave=interleave, **kw) is None
            assert_close(q, eq, atol, rtol, name="q in place")
            assert_close(k, ek, atol, rtol, name="k in place")


@pytest.mark.interpret
@pytest.mark.parametrize("interleave", [False, True])
def test_rope_tiles_mix_query_and_key_heads(interleave):
    """Tiles of two heads over 3 query + 2 key heads: one tile holds the last query head and the first key head,
    the last tile has an idle row; out of place with half the head rotated (the rest copied)."""
    from flashinfer_triton._config import RopeConfig
    from flashinfer_triton.kernels.rope import launch_rope

    dev = "cuda" if HAS_CUDA else "cpu"
    nnz, hq, hk, d, rot = 3, 3, 2, 32, 16
    q, k = _qk(nnz, hq, hk, d, torch.float32, dev)
    pos = torch.randint(0, MAX_POS, (nnz,), device=dev)
    ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * ref_freq(rot, 1.0, 1e4)[None, :]
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    launch_rope(
        q, k, q_out, k_out, pos, rot, interleave, cache.to(dev), 0.0, 1.0, 0.0, 0.0, cfg=RopeConfig(tile_pairs=16)
    )
    c = cache.double()[pos.cpu()]
    for x, o, name in ((q, q_out, "q"), (k, k_out, "k")):
        expected = ref_rotate(x.cpu(), pos, rot, interleave, c[:, : rot // 2], c[:, rot // 2 :])
        assert_close(o, expected, 1e-4, 1e-4, name=f"{name} tiles of two heads")


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_indptr_offsets(path, shapes, dtype):
    dev = _device(path)
    atol, rtol = _tol(dtype)
    for nnz, hq, hk, d in shapes:
        cuts = sorted(torch.randint(0, nnz + 1, (2,)).tolist())
        indptr = torch.tensor([0, *cuts, nnz], dtype=torch.int32, device=dev)
        offsets = torch.randint(0, 1000, (3,), dtype=torch.int32, device=dev)
        pos = torch.cat([offsets[b].cpu() + torch.arange(int(indptr[b + 1] - indptr[b])) for b in range(3)])
        q, k = _qk(nnz, hq, hk, d, dtype, dev)
        freq = ref_freq(d, 1.0, 1e4)
        eq, ek = ref_rope(q, pos, d, False, freq), ref_rope(k, pos, d, False, freq)
        qr, kr = rope.apply_rope(q, k, indptr, offsets)
        assert_close(qr, eq, atol, rtol, name="apply_rope q")
        assert_close(kr, ek, atol, rtol, name="apply_rope k")
        freq31 = ref_freq(d, 8.0, 5e5, (1.0, 4.0, 8192))
        e31 = ref_rope(q, pos, d, True, freq31)
        q31, _ = rope.apply_llama31_rope(q, k, indptr.long(), offsets.long(), interleave=True)
        assert_close(q31, e31, atol, rtol, name="apply_llama31_rope q")
        rope.apply_rope_inplace(q, k, indptr, offsets)
        assert_close(q, eq, atol, rtol, name="apply_rope_inplace q")
        q2, k2 = _qk(nnz, hq, hk, d, dtype, dev)
        e2 = ref_rope(k2, pos, d, False, freq31)
        rope.apply_llama31_rope_inplace(q2, k2, indptr, offsets)
        assert_close(k2, e2, atol, rtol, name="apply_llama31_rope_inplace k")


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_cos_sin_cache(path, shapes, dtype, is_neox):
    dev = _device(path)
    atol, rtol = _tol(dtype)
    for nnz, hq, hk, d in shapes:
        for rot in (d, d // 2):
            ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * ref_freq(rot, 1.0, 1e4)[None, :]
            cache = torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()
            q, k = _qk(nnz, hq, hk, d, dtype, dev)
            query, key = q.reshape(nnz, hq * d), k.reshape(nnz, hk * d)
            pos = torch.randint(0, MAX_POS, (nnz,), device=dev)
            c = cache.double()[pos.cpu()]
            eq = ref_rotate(q.cpu(), pos, rot, not is_neox, c[:, : rot // 2], c[:, rot // 2 :])
            ek = ref_rotate(k.cpu(), pos, rot, not is_neox, c[:, : rot // 2], c[:, rot // 2 :])
            qo, ko = rope.apply_rope_with_cos_sin_cache(pos, query, key, d, cache.to(dev), is_neox=is_neox)
            assert qo.shape == query.shape and ko.shape == key.shape
            assert_close(qo.view(nnz, hq, d), eq, atol, rtol, name="cache q")
            assert_close(ko.view(nnz, hk, d), ek, atol, rtol, name="cache k")
            rope.apply_rope_with_cos_sin_cache_inplace(pos.int(), query, key, d, cache.to(dev), is_neox=is_neox)
            assert_close(q, eq, atol, rtol, name="cache q in place")
            assert_close(k, ek, atol, rtol, name="cache k in place")


@pytest.mark.gpu
def test_rope_cos_sin_cache_forms_across_token_counts():
    """An engine's calls: q and k views of one qkv row, one token first (whose views have other strides), then
    more: each call of a kept call form (``_row_forms``, bound launches) rotates exactly as the reference, in
    place and out of place, and a form of many tokens serves a token count it was not bound at."""
    hq, hk, d = 9, 3, 64
    ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * ref_freq(d, 1.0, 1e4)[None, :]
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float().cuda()
    atol, rtol = _tol(torch.bfloat16)
    for nnz in (1, 37, 1, 256, 5):
        qkv = torch.randn(nnz, (hq + 2 * hk) * d, device="cuda").to(torch.bfloat16)
        query, key = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
        pos = torch.randint(0, MAX_POS, (nnz,), device="cuda")
        c = cache.double().cpu()[pos.cpu()]
        eq = ref_rotate(query.cpu().view(nnz, hq, d), pos, d, False, c[:, : d // 2], c[:, d // 2 :])
        ek = ref_rotate(key.cpu().view(nnz, hk, d), pos, d, False, c[:, : d // 2], c[:, d // 2 :])
        qo, ko = rope.apply_rope_with_cos_sin_cache(pos, query, key, d, cache)
        assert_close(qo.view(nnz, hq, d), eq, atol, rtol, name=f"cache q nnz={nnz}")
        assert_close(ko.view(nnz, hk, d), ek, atol, rtol, name=f"cache k nnz={nnz}")
        rest = qkv[:, (hq + hk) * d :].clone()
        rope.apply_rope_with_cos_sin_cache_inplace(pos, query, key, d, cache)
        assert_close(query.view(nnz, hq, d), eq, atol, rtol, name=f"cache q in place nnz={nnz}")
        assert_close(key.view(nnz, hk, d), ek, atol, rtol, name=f"cache k in place nnz={nnz}")
        assert torch.equal(qkv[:, (hq + hk) * d :], rest)  # (v untouched)


@pytest.mark.parametrize("inplace", [True, False])
def test_rope_cos_sin_cache_no_tokens(inplace):
    """An empty batch: nothing to rotate, no error (the head views of no tokens are given their head counts)."""
    query, key = torch.empty(0, 3 * 64), torch.empty(0, 64)
    pos, cache = torch.empty(0, dtype=torch.int64), torch.randn(16, 64)
    if inplace:
        assert rope.apply_rope_with_cos_sin_cache_inplace(pos, query, key, 64, cache) is None
    else:
        qo, ko = rope.apply_rope_with_cos_sin_cache(pos, query, key, 64, cache)
        assert qo.shape == query.shape and ko.shape == key.shape


def test_errors():
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.apply_rope_pos_ids(q, k, pos, rotary_dim=63)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.apply_rope_pos_ids(q, k, pos, rotary_dim=128)
    with pytest.raises(ValueError, match="pos_ids"):
        rope.apply_rope_pos_ids(q, k, torch.arange(3))
    with pytest.raises(TypeError, match="pos_ids"):
        rope.apply_rope_pos_ids(q, k, pos.float())
    with pytest.raises(ValueError, match="k"):
        rope.apply_rope_pos_ids(q, torch.randn(4, 1, 32), pos)
    with pytest.raises(TypeError, match="k"):
        rope.apply_rope_pos_ids(q, k.half(), pos)
    with pytest.raises(ValueError, match="rope_theta"):
        rope.apply_rope_pos_ids(q, k, pos, rope_theta=0.0)
    with pytest.raises(ValueError, match="offsets"):
        rope.apply_rope(q, k, torch.tensor([0, 2, 4]), torch.tensor([0]))
    with pytest.raises(ValueError, match="float32"):
        rope.apply_rope_with_cos_sin_cache_inplace(pos, q.view(4, -1), k.view(4, -1), 64, torch.randn(8, 64).half())
    with pytest.raises(ValueError, match="head_size"):
        rope.apply_rope_with_cos_sin_cache_inplace(pos, q.view(4, -1), k.view(4, -1), 48, torch.randn(8, 48))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope.apply_rope_with_cos_sin_cache_inplace(pos, q.view(4, -1), k.view(4, -1), 64, torch.randn(8, 66))
