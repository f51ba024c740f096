"""vLLM's cache operations and the vLLM decode kernel's less common inputs: float32 queries, padded head sizes,
``reshape_and_cache_flash`` (NHD and a permuted HND allocation), ``copy_blocks``, ``swap_blocks``, ``convert_fp8``.

Each case runs on CPU tensors: the PyTorch path without the interpreter, the Triton kernels under
``TRITON_INTERPRET=1`` (``interpret``); the ``gpu`` cases on CUDA. References are built element by element here.
"""

from __future__ import annotations

import pytest
import torch

from flashinfer_triton import vllm
from test_vllm import DEVICE, HAS_CUDA, INTERPRET, Case, _poison_tails, check_v1, check_v2

# The cache operations on CPU tensors: the PyTorch path (plain CPU runs) and the kernels (the interpreter).
PATHS = [
    pytest.param(
        "torch", marks=pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="CPU tensors without the interpreter")
    ),
    pytest.param("kernel", marks=pytest.mark.interpret),
]

# ---------------------------------------------------------------- attention: float32, padded heads


@pytest.mark.interpret
@pytest.mark.parametrize(
    "head_size,dtype,block_size", [(120, torch.float16, 16), (40, torch.float32, 8), (24, torch.bfloat16, 8)]
)
def test_padded_heads_and_float32(head_size, dtype, block_size):
    """Head sizes below a power of two (120 / 40 / 24 in tiles of 128 / 64 / 32; float32: x = 4), NaN tails, v1 and
    v2 with a sequence crossing a partition boundary."""
    case = Case([530, 9, 0], num_heads=4, num_kv_heads=2, head_size=head_size, block_size=block_size, dtype=dtype,
                alibi=True)  # fmt: skip
    _poison_tails(case)
    check_v1(case)
    check_v2(case)


@pytest.mark.interpret
def test_size_one_dims_with_odd_strides():
    """One KV head and one block: the caches' size-1 dimensions may have any stride (never stepped over)."""
    case = Case([7], num_heads=2, num_kv_heads=1, head_size=64, block_size=8, spare_blocks=0, extra_table=0)
    kc, vc = case.key_cache, case.value_cache
    assert kc.shape[0] == 1 and kc.shape[1] == 1
    case.key_cache = kc.as_strided(kc.shape, (3, 5, *kc.stride()[2:]))
    case.value_cache = vc.as_strided(vc.shape, (7, 11, *vc.stride()[2:]))
    check_v1(case)
    check_v2(case)


# ---------------------------------------------------------------- cache writes


def _flash_caches(num_blocks, block_size, heads, head_size, dtype, layout, cache_dtype=None):
    """Random K/V caches [num_blocks, block_size, heads, head_size]: NHD allocated as is, HND allocated as
    [num_blocks, heads, block_size, head_size] and viewed (permuted) as NHD."""
    cache_dtype = cache_dtype or dtype
    shape = (
        (num_blocks, block_size, heads, head_size) if layout == "NHD" else (num_blocks, heads, block_size, head_size)
    )
    caches = []
    for _ in range(2):
        c = torch.randn(shape, device=DEVICE).to(cache_dtype)
        caches.append(c if layout == "NHD" else c.permute(0, 2, 1, 3))
    return caches


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_reshape_and_cache_flash(layout, kv_cache_dtype, path):
    num_tokens, heads, head_size, block_size, num_blocks = 7, 2, 24, 4, 5
    dtype = torch.float16
    scales = (0.5, 2.0) if kv_cache_dtype == "fp8" else (1.0, 1.0)
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else dtype
    key = (torch.randn(num_tokens, heads, head_size, device=DEVICE) * 2).to(dtype)
    value = (torch.randn(num_tokens, heads, head_size, device=DEVICE) * 2).to(dtype)
    if kv_cache_dtype == "fp8":
        # Exactly representable after the division (the interpreter's float -> fp8 rounding is not IEEE's at binade
        # boundaries): the check is of addressing and scaling, not rounding.
        key = (key.float().cpu().div(scales[0]).to(cache_dtype).float() * scales[0]).to(dtype).to(DEVICE)
        value = (value.float().cpu().div(scales[1]).to(cache_dtype).float() * scales[1]).to(dtype).to(DEVICE)
    kc, vc = _flash_caches(num_blocks, block_size, heads, head_size, dtype, layout, cache_dtype)
    slots = torch.tensor([5, -1, 0, 19, 8, 11, 3], dtype=torch.int64, device=DEVICE)
    want_k, want_v = kc.float().cpu().clone(), vc.float().cpu().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // block_size, s % block_size] = (key[t].float().cpu() / scales[0]).to(cache_dtype).float()
            want_v[s // block_size, s % block_size] = (value[t].float().cpu() / scales[1]).to(cache_dtype).float()
    ks = torch.tensor([scales[0]], device=DEVICE) if kv_cache_dtype == "fp8" else scales[0]
    args_k = kc.view(torch.uint8) if kv_cache_dtype == "fp8" else kc
    args_v = vc.view(torch.uint8) if kv_cache_dtype == "fp8" else vc
    vllm.reshape_and_cache_flash(key, value, args_k, args_v, slots, kv_cache_dtype, ks, scales[1])
    assert torch.equal(kc.float().cpu(), want_k)
    assert torch.equal(vc.float().cpu(), want_v)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=["bf16", "fp32", "fp8-bytes"])
def test_copy_blocks(dtype, path):
    num_blocks, layers = 9, 2
    mapping = torch.tensor([[1, 4], [1, 7], [0, 2], [8, 3]], dtype=torch.int64, device=DEVICE)

    def cache(shape):
        if dtype == torch.uint8:
            return torch.randint(0, 255, shape, dtype=torch.uint8, device=DEVICE)
        return torch.randn(shape, device=DEVICE).to(dtype)

    kcs = [cache((num_blocks, 2, 3, 8, 8)) for _ in range(layers)]
    vcs = [cache((num_blocks, 2, 24, 8)) for _ in range(layers)]
    want = [c.clone() for c in kcs + vcs]
    for w in want:
        for s, d in mapping.tolist():
            w[d] = w[s]
    vllm.copy_blocks(kcs, vcs, mapping)
    for got, w in zip(kcs + vcs, want):
        assert torch.equal(got, w)


def test_swap_blocks_cpu():
    src = torch.randn(6, 2, 16, 4)
    dst = torch.randn(5, 2, 16, 4)
    before = dst.clone()
    mapping = torch.tensor([[5, 0], [2, 3]], dtype=torch.int64)
    vllm.swap_blocks(src, dst, mapping)
    assert torch.equal(dst[0], src[5]) and torch.equal(dst[3], src[2])
    assert torch.equal(dst[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize("kv_dtype,fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_convert_fp8_round_trip(kv_dtype, fp8):
    x = torch.randn(4, 3, 16) * 100
    x[0, 0, 0] = 1e6  # saturates
    q = torch.empty(x.shape, dtype=torch.uint8)
    vllm.convert_fp8(q, x, 0.5, kv_dtype)
    want = (x / 0.5).clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max).to(fp8)  # saturated to the format's range
    assert torch.equal(q, want.view(torch.uint8))
    back = torch.empty_like(x, dtype=torch.float16)
    vllm.convert_fp8(back, q, 0.5, kv_dtype)
    assert torch.equal(back, (want.float() * 0.5).half())
    with pytest.raises(ValueError, match="kv_dtype"):
        vllm.convert_fp8(q, x, 1.0, "int8")
    with pytest.raises(TypeError, match="output"):
        vllm.convert_fp8(back, x, 1.0)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_reshape_and_cache_flash_large(layout, kv_cache_dtype):
    num_tokens, heads, head_size, block_size, num_blocks = 300, 8, 80, 16, 64
    dtype = torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else dtype
    key = torch.randn(num_tokens, heads, head_size, device=DEVICE).to(dtype)
    value = torch.randn(num_tokens, heads, head_size, device=DEVICE).to(dtype)
    kc, vc = _flash_caches(num_blocks, block_size, heads, head_size, dtype, layout, cache_dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::7] = -1
    scale = torch.tensor([0.25], device=DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    keep = slots >= 0
    s = slots[keep]
    div = 0.25 if kv_cache_dtype == "fp8" else 1.0
    want_k[s // block_size, s % block_size] = (key[keep].float() / div).to(cache_dtype)
    want_v[s // block_size, s % block_size] = (value[keep].float() / div).to(cache_dtype)
    vllm.reshape_and_cache_flash(key, value, kc, vc, slots, kv_cache_dtype, scale, scale)
    assert torch.equal(kc.view(torch.uint8) if kv_cache_dtype == "fp8" else kc,
                       want_k.view(torch.uint8) if kv_cache_dtype == "fp8" else want_k)  # fmt: skip
    assert torch.equal(vc.view(torch.uint8) if kv_cache_dtype == "fp8" else vc,
                       want_v.view(torch.uint8) if kv_cache_dtype == "fp8" else want_v)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="GPU to CPU copies")
@pytest.mark.parametrize("direction", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")])
def test_gpu_swap_blocks(direction):
    src = torch.randn(40, 8, 64, 16, device=direction[0]).half()
    dst = torch.randn(30, 8, 64, 16, device=direction[1]).half()
    before = dst.clone()
    mapping = torch.tensor([[39, 0], [3, 29], [17, 5]], dtype=torch.int64)
    vllm.swap_blocks(src, dst, mapping)
    for s, d in mapping.tolist():
        assert torch.equal(dst[d].cpu(), src[s].cpu())
    untouched = [i for i in range(30) if i not in (0, 29, 5)]
    assert torch.equal(dst[untouched].cpu(), before[untouched].cpu())
    with pytest.raises(ValueError, match="block_mapping"):
        vllm.swap_blocks(src, dst, mapping.to(DEVICE))
