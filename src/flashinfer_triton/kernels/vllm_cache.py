"""vLLM's cache writes: ``reshape_and_cache`` / ``reshape_and_cache_flash`` and ``copy_blocks``.

Token ``t`` goes to slot ``s = slot_mapping[t]`` (block ``s // block_size``, offset ``s % block_size``);
``s < 0`` (padding) writes nothing. Keys land in ``key_cache [blocks, Hkv, D/X, block_size, X]`` (element
``d`` at ``[.., d // X, offset, d % X]``), values in ``value_cache [blocks, Hkv, D, block_size]``; the flash
layout ``[blocks, block_size, Hkv, D]`` is the same addressing with strides (``KX = 0``: no key chunks).
fp8 caches store ``x / scale`` rounded to the fp8 format, saturated to its largest finite value (vLLM's
``scaled_convert``; attention multiplies by the same scale when reading).

One program per (token, block of KV heads); the slot is read once per program. A slot past the cache (``>=
num_blocks * block_size``) writes nothing and records a device-side error (``_errors.py``, code 4); so does a
``copy_blocks`` pair naming a block past the cache (code 5).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    err_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kch,
    stride_kcx,
    stride_kcs,
    stride_vcb,
    stride_vch,
    stride_vcd,
    stride_vcs,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KX: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: cache in the input dtype; else the fp8 format's largest finite value
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    past = slot >= num_slots
    if past & (hb == 0):
        old = tl.atomic_cas(err_ptr, 0, 4)
        if old == 0:
            tl.store(err_ptr + 1, t.to(tl.int32))
            tl.store(err_ptr + 2, slot.to(tl.int32))
    write = (slot >= 0) & (slot < num_slots)
    blk = tl.where(write, slot, 0) // PAGE_SIZE
    off = tl.where(write, slot, 0) % PAGE_SIZE
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & write
    h64 = heads.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t * stride_kt + h64 * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h64 * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if FP8_MAX > 0:
        k = k.to(tl.float32) / tl.load(k_scale_ptr).to(tl.float32)
        v = v.to(tl.float32) / tl.load(v_scale_ptr).to(tl.float32)
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    if KX > 0:
        k_d = (offs_d // KX) * stride_kcx + offs_d % KX
    else:
        k_d = offs_d
    kc = kc_ptr + blk * stride_kcb + h64 * stride_kch + off * stride_kcs + k_d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    vc = vc_ptr + blk * stride_vcb + h64 * stride_vch + off * stride_vcs + offs_d[None, :].to(tl.int64) * stride_vcd
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t, fp8_max, strides,
                             kx, block_size, num_blocks, err):  # fmt: skip
    """Launch on already-checked tensors (fp8 caches viewed as float8; scales as one-element tensors); ``strides`` =
    (key block, key head, key chunk, key slot, value block, value head, value element, value slot)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t, err, num_blocks * block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, PAGE_SIZE=int(block_size),
        KX=int(kx), FP8_MAX=float(fp8_max), num_warps=4,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(cache_ptr, map_ptr, err_ptr, stride_block, num_blocks, block_numel, BLOCK: tl.constexpr):
    """Pair ``i`` of ``block_mapping``: copy block ``src`` onto block ``dst`` (BLOCK elements per program)."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    src = tl.load(map_ptr + 2 * i).to(tl.int64)
    dst = tl.load(map_ptr + 2 * i + 1).to(tl.int64)
    ok = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    if (not ok) & (c == 0):
        old = tl.atomic_cas(err_ptr, 0, 5)
        if old == 0:
            tl.store(err_ptr + 1, i.to(tl.int32))
            tl.store(err_ptr + 2, tl.where((src >= 0) & (src < num_blocks), dst, src).to(tl.int32))
    offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < block_numel) & ok
    vals = tl.load(cache_ptr + src * stride_block + offs, mask=mask)
    tl.store(cache_ptr + dst * stride_block + offs, vals, mask=mask)


def launch_copy_blocks(cache, block_mapping, err):
    """``cache`` [num_blocks, ...] with contiguous blocks, viewed as an integer type of its element size."""
    pairs = block_mapping.shape[0]
    block_numel = cache[0].numel()
    block = min(4096, triton.next_power_of_2(max(block_numel, 16)))
    grid = (pairs, triton.cdiv(block_numel, block))
    mapping = block_mapping if block_mapping.is_contiguous() else block_mapping.contiguous()
    _copy_blocks_kernel[grid](cache, mapping, err, cache.stride(0), cache.shape[0], block_numel, BLOCK=block,
                              num_warps=4)  # fmt: skip
