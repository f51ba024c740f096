"""Rotary position embedding of query and key heads, in place or out of place.

A program rotates ``HEADS`` heads of one token: a ``[HEADS, ROT/2]`` tile of first elements and one of
second elements of each rotated pair (the two halves of the rotary part for the NeoX layout, the even
and odd elements for the interleaved layout), so each element is read and written once. Grid axis 1
covers the query heads first, then the key heads. The angle of pair ``j`` at position ``p`` is
``p * f_j`` with ``f_j = theta^(-2j/rot)`` divided by ``rope_scale`` (Llama 3.1 blends the scaled and
unscaled frequency by ``clamp(f_j * smooth_a + smooth_b, 0, 1)``), or ``cos``/``sin`` come from a
float32 ``[max_pos, rot]`` cache (cosines first, sines second). Elements past ``rot`` are copied when
the output is a different tensor.
"""

import triton
import triton.language as tl


@triton.jit
def _rope_heads(
    x_ptr,
    o_ptr,
    sxn,
    sxh,
    son,
    soh,
    tok,
    h0,
    num_heads,
    cos,
    sin,
    head_dim,
    HALF: tl.constexpr,
    BLOCK_J: tl.constexpr,
    HEADS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    COPY_REST: tl.constexpr,
    REST: tl.constexpr,
):
    offs_h = h0 + tl.arange(0, HEADS)
    offs_j = tl.arange(0, BLOCK_J)
    mask_h = offs_h < num_heads
    x_row = x_ptr + tok * sxn + offs_h[:, None].to(tl.int64) * sxh
    o_row = o_ptr + tok * son + offs_h[:, None].to(tl.int64) * soh
    if INTERLEAVE:
        i1 = 2 * offs_j[None, :]
        i2 = i1 + 1
    else:
        i1 = offs_j[None, :]
        i2 = i1 + HALF
    m = mask_h[:, None] & (offs_j[None, :] < HALF)
    x1 = tl.load(x_row + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=m, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(o_row + i1, y1.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(o_row + i2, y2.to(o_ptr.dtype.element_ty), mask=m)
    if COPY_REST:
        offs_r = 2 * HALF + tl.arange(0, REST)
        mr = mask_h[:, None] & (offs_r[None, :] < head_dim)
        rest = tl.load(x_row + offs_r[None, :], mask=mr, other=0.0)
        tl.store(o_row + offs_r[None, :], rest, mask=mr)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cache_ptr,
    sqn,
    sqh,
    skn,
    skh,
    sqon,
    sqoh,
    skon,
    skoh,
    num_q_heads,
    num_k_heads,
    head_dim,
    log2_rcp_theta,
    rcp_scale,
    smooth_a,
    smooth_b,
    HALF: tl.constexpr,
    BLOCK_J: tl.constexpr,
    HEADS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    USE_CACHE: tl.constexpr,
    COPY_REST: tl.constexpr,
    REST: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    pos = tl.load(pos_ptr + tok)
    offs_j = tl.arange(0, BLOCK_J)
    if USE_CACHE:
        c_row = cache_ptr + pos.to(tl.int64) * (2 * HALF)
        cos = tl.load(c_row + offs_j, mask=offs_j < HALF, other=0.0)
        sin = tl.load(c_row + HALF + offs_j, mask=offs_j < HALF, other=0.0)
    else:
        freq = tl.exp2(log2_rcp_theta * (offs_j.to(tl.float32) * 2.0 / (2 * HALF)))
        smooth = tl.minimum(tl.maximum(freq * smooth_a + smooth_b, 0.0), 1.0)
        freq = (1.0 - smooth) * (freq * rcp_scale) + smooth * freq
        ang = pos.to(tl.float32) * freq
        cos = tl.cos(ang)
        sin = tl.sin(ang)
    q_blocks = tl.cdiv(num_q_heads, HEADS)
    if blk < q_blocks:
        _rope_heads(
            q_ptr, qo_ptr, sqn, sqh, sqon, sqoh, tok, blk * HEADS, num_q_heads, cos, sin, head_dim,
            HALF, BLOCK_J, HEADS, INTERLEAVE, COPY_REST, REST,
        )  # fmt: skip
    else:
        _rope_heads(
            k_ptr, ko_ptr, skn, skh, skon, skoh, tok, (blk - q_blocks) * HEADS, num_k_heads, cos, sin, head_dim,
            HALF, BLOCK_J, HEADS, INTERLEAVE, COPY_REST, REST,
        )  # fmt: skip


def launch_rope(
    q, k, q_out, k_out, pos_ids, rotary_dim, interleave, cache, log2_rcp_theta, rcp_scale, smooth_a, smooth_b
):
    """``q``/``k``/outs: ``[nnz, heads, head_dim]`` views with a contiguous last dimension; ``pos_ids``:
    ``[nnz]`` int32/int64; ``cache``: None or a contiguous float32 ``[max_pos, rotary_dim]``."""
    nnz, hq, head_dim = q.shape
    hk = k.shape[1]
    if nnz == 0:
        return
    half = rotary_dim // 2
    block_j = triton.next_power_of_2(half)
    heads = max(1, min(triton.next_power_of_2(max(hq, hk)), max(1, 2048 // block_j), 16))
    copy_rest = rotary_dim < head_dim and (q_out.data_ptr() != q.data_ptr() or k_out.data_ptr() != k.data_ptr())
    rest = triton.next_power_of_2(max(head_dim - rotary_dim, 1))
    grid = (nnz, triton.cdiv(hq, heads) + triton.cdiv(hk, heads))
    _rope_kernel[grid](
        q, k, q_out, k_out, pos_ids, cache if cache is not None else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        hq, hk, head_dim, float(log2_rcp_theta), float(rcp_scale), float(smooth_a), float(smooth_b),
        HALF=half, BLOCK_J=block_j, HEADS=heads, INTERLEAVE=bool(interleave), USE_CACHE=cache is not None,
        COPY_REST=copy_rest, REST=rest, num_warps=4 if heads * block_j >= 1024 else 2,
    )  # fmt: skip
