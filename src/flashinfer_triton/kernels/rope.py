"""Rotary position embedding of query and key heads, in place or out of place.

A program rotates ``HEADS`` heads of one token: a ``[HEADS, ROT/2]`` tile of first elements and one of
second elements of each rotated pair (the two halves of the rotary part for the NeoX layout, the even
and odd elements for the interleaved layout), so each element is read and written once. A token's heads
are numbered query heads first, then key heads, and grid axis 1 tiles that numbering, so a tile may hold
both (SmolLM2's 9 + 3 heads are one program per token). The angle of pair ``j`` at position ``p`` is
``p * f_j`` with ``f_j = theta^(-2j/rot)`` divided by ``rope_scale`` (Llama 3.1 blends the scaled and
unscaled frequency by ``clamp(f_j * smooth_a + smooth_b, 0, 1)``), or ``cos``/``sin`` come from a
float32 ``[max_pos, rot]`` cache (cosines first, sines second). Elements past ``rot`` are copied when
the output is a different tensor.

The launch lasts a few microseconds, most of it memory latency: the position and the heads are loaded
first, so the heads' loads are in flight while the position, then its cache row, come back (two round
trips to memory rather than three).
"""

import triton
import triton.language as tl

from .. import _config
from .._launch import FastKernel
from ._row_forms import BoundForms


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
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs_j = tl.arange(0, BLOCK_J)
    is_q = h < num_q_heads
    mask_h = h < num_q_heads + num_k_heads
    hq = tl.where(is_q, h, 0).to(tl.int64)[:, None]
    hk = tl.where(is_q, 0, h - num_q_heads).to(tl.int64)[:, None]
    q_rows = is_q[:, None]
    x_row = tl.where(q_rows, q_ptr + tok * sqn + hq * sqh, k_ptr + tok * skn + hk * skh)
    o_row = tl.where(q_rows, qo_ptr + tok * sqon + hq * sqoh, ko_ptr + tok * skon + hk * skoh)
    if INTERLEAVE:
        i1 = 2 * offs_j[None, :]
        i2 = i1 + 1
    else:
        i1 = offs_j[None, :]
        i2 = i1 + HALF
    m = mask_h[:, None] & (offs_j[None, :] < HALF)
    pos = tl.load(pos_ptr + tok)
    x1 = tl.load(x_row + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=m, other=0.0).to(tl.float32)
    if COPY_REST:
        offs_r = 2 * HALF + tl.arange(0, REST)
        mr = mask_h[:, None] & (offs_r[None, :] < head_dim)
        rest = tl.load(x_row + offs_r[None, :], mask=mr, other=0.0)
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
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(o_row + i1, y1.to(qo_ptr.dtype.element_ty), mask=m)
    tl.store(o_row + i2, y2.to(qo_ptr.dtype.element_ty), mask=m)
    if COPY_REST:
        tl.store(o_row + offs_r[None, :], rest, mask=mr)


_rope_forms = BoundForms(FastKernel(_rope_kernel), 6, "rope")


def launch_rope(
    q,
    k,
    q_out,
    k_out,
    pos_ids,
    rotary_dim,
    interleave,
    cache,
    log2_rcp_theta,
    rcp_scale,
    smooth_a,
    smooth_b,
    cfg=None,
    form=None,
):
    """``q``/``k``/outs: ``[nnz, heads, head_dim]`` views with a contiguous last dimension, one dtype;
    ``pos_ids``: ``[nnz]`` int32/int64; ``cache``: None or a contiguous float32 ``[max_pos, rotary_dim]``. ``form``:
    the caller's key of this call form, which must fix every argument here but the tensors' addresses and ``nnz``
    (the public functions' checked forms, ``_row_forms``); None: the key of the arguments themselves."""
    cfg = cfg or _config.ROPE
    nnz, hq, head_dim = q.shape
    hk = k.shape[1]
    if nnz == 0:
        return
    half = rotary_dim // 2
    block_j = _config.next_pow2(half)
    heads = max(1, min(_config.next_pow2(hq + hk), cfg.tile_pairs // block_j))
    copy_rest = rotary_dim < head_dim and (q_out.data_ptr() != q.data_ptr() or k_out.data_ptr() != k.data_ptr())
    rest = _config.next_pow2(max(head_dim - rotary_dim, 1))
    grid = (nnz, _config.cdiv(hq + hk, heads))
    table = cache if cache is not None else q
    args = (
        q, k, q_out, k_out, pos_ids, table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        hq, hk, head_dim, float(log2_rcp_theta), float(rcp_scale), float(smooth_a), float(smooth_b),
        half, block_j, heads, bool(interleave), cache is not None, copy_rest, rest,
    )  # fmt: skip
    warps = cfg.warps(heads * block_j)
    if form is None:
        form = (grid[1], args[6:], q.dtype, k.dtype, q_out.dtype, k_out.dtype, pos_ids.dtype, table.dtype, warps)
    _rope_forms.launch(form, args, grid, num_warps=warps)
